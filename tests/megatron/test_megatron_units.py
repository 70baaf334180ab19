"""bcp-megatron's pure parts in one process: Megatron keys to bcp entries, ShardedTensors to boxes
(layer-stacked, ``flattened_range``, clipping), the object envelope, the
backend checks and the launcher's argument rewriting."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException

import bcp
from bcp.layout import Box
from bcp_megatron import BcpLoadShardedStrategy
from bcp_megatron.launch import rewrite_args
from bcp_megatron.shards import clip_to, entry_name, restored, sharded_key, storable, tensor_shards


def test_optimizer_keys_form_the_optimizer_component():
    assert entry_name("decoder.layers.mlp.linear_fc1.weight") == "model/decoder.layers.mlp.linear_fc1.weight"
    key = "optimizer.state.exp_avg.embedding.weight"
    assert entry_name(key) == f"optimizer/{key}"
    assert sharded_key(entry_name("rng_state/shard_0.0_1.2")) == "rng_state/shard_0.0_1.2"


def test_layer_stacked_shard_is_a_view_with_unit_leading_axes():
    data = torch.zeros(4, 6)
    sh = ShardedTensor.from_rank_offsets("w", data, (1, 1, 2), (0, 3, 5), prepend_axis_num=1)
    [shard] = tensor_shards(sh)
    assert shard.global_shape == (5, 8, 6) and shard.offsets == (3, 4, 0) and shard.tensor.shape == (1, 4, 6)
    shard.tensor.fill_(2.0)  # loading writes through to the ShardedTensor's data
    assert torch.all(data == 2.0)


def test_flattened_range_becomes_regular_boxes_covering_exactly_the_range():
    chunk = torch.arange(24.0).reshape(4, 6)
    sh = ShardedTensor.from_rank_offsets("w", chunk.clone(), (0, 1, 2))  # rows 4..7 of an 8x6 tensor
    sh.flattened_range = slice(5, 20)  # as Megatron <= 0.15 builds it
    sh.data = chunk.reshape(-1)[5:20].clone()
    shards = tensor_shards(sh)
    covered = torch.full((8, 6), -1.0)
    for shard in shards:
        box = Box(shard.offsets, tuple(shard.tensor.shape))
        assert torch.all(covered[box.slices()] == -1)
        covered[box.slices()] = shard.tensor
    expected = torch.full((8, 6), -1.0)
    expected.view(-1)[24 + 5: 24 + 20] = torch.arange(5.0, 20.0)
    assert torch.equal(covered, expected)
    assert len(shards) == 3 and all(s.tensor.data_ptr() >= sh.data.data_ptr() for s in shards)


def test_clip_keeps_what_lies_inside_the_saved_shape():
    sh = ShardedTensor.from_rank_offsets("embedding", torch.zeros(6, 4), (0, 1, 2))  # rows 6..11 of 12
    [clipped] = clip_to(tensor_shards(sh), (8, 4))
    assert clipped.offsets == (6, 0) and tuple(clipped.tensor.shape) == (2, 4) and clipped.global_shape == (8, 4)
    sh_outside = ShardedTensor.from_rank_offsets("embedding", torch.zeros(6, 4), (0, 1, 2))
    assert clip_to(tensor_shards(sh_outside), (6, 4)) == []


def test_object_envelope_round_trip():
    for value in (None, {"lr": 1e-3, (torch.float32,): [1]}):
        assert restored(storable(value)) == value
    assert torch.equal(restored(storable(torch.ones(2))), torch.ones(2))
    assert restored(storable(io.BytesIO(b"fp8 meta"))).getvalue() == b"fp8 meta"
    with pytest.raises(bcp.CorruptCheckpointError, match="one-element list"):
        restored({"not": "an envelope"})


def test_load_strategy_refuses_other_backends_and_versions():
    strategy = BcpLoadShardedStrategy()
    strategy.check_backend_compatibility("bcp")
    strategy.check_version_compatibility(1)
    with pytest.raises(CheckpointingException, match="'torch_dist' backend") as refused:
        strategy.check_backend_compatibility("torch_dist")
    assert isinstance(refused.value, bcp.FormatVersionError)
    with pytest.raises(CheckpointingException, match="version 2 of the bcp backend") as refused:
        strategy.check_version_compatibility(2)
    assert isinstance(refused.value, bcp.FormatVersionError)


def test_bcp_errors_are_megatron_exceptions_and_keep_their_class_and_message():
    from bcp_megatron.errors import as_megatron_errors

    with pytest.raises(CheckpointingException) as raised, as_megatron_errors():
        raise bcp.CorruptCheckpointError("crc mismatch", path="/ckpt", key="model/w")
    error = raised.value
    assert isinstance(error, bcp.CorruptCheckpointError) and type(error).__name__ == "CorruptCheckpointError"
    assert str(error) == "crc mismatch (checkpoint '/ckpt', entry 'model/w')" and error.key == "model/w"
    assert pickle.loads(pickle.dumps(error)).args == error.args  # Megatron's checkpoint worker pickles errors
    with pytest.raises(ValueError), as_megatron_errors():  # not bcp's: untouched
        raise ValueError("x")


@pytest.mark.parametrize("args,expected,requested", [
    (["--ckpt-format", "bcp", "--save", "x"], ["--ckpt-format", "torch_dist", "--save", "x"], True),
    (["--ckpt-format=bcp"], ["--ckpt-format=torch_dist"], True),
    (["--ckpt-format", "bcp", "--ckpt-format", "torch"], ["--ckpt-format", "torch_dist", "--ckpt-format", "torch"],
     False),
    (["--ckpt-format", "torch_dist"], ["--ckpt-format", "torch_dist"], False),
])
def test_launcher_routes_bcp_through_the_torch_dist_paths(args, expected, requested):
    assert rewrite_args(args) == (expected, requested)


def test_launcher_binds_bcp_in_the_016_layout_and_refuses_unknown_ones():
    import types

    from bcp_megatron import BcpSaveShardedStrategy
    from bcp_megatron.launch import install_routes

    checkpointing = types.ModuleType("megatron.training.checkpointing")
    checkpointing.get_default_save_sharded_strategy = lambda backend="torch_dist", version=1: None
    install_routes(checkpointing)
    assert isinstance(checkpointing.get_default_save_sharded_strategy("torch_dist"), BcpSaveShardedStrategy)
    with pytest.raises(SystemExit, match="neither the 0.16 nor the 0.17 layout"):
        install_routes(types.ModuleType("megatron.training.checkpointing"))


def test_the_step_of_a_save_is_the_iteration_megatron_lm_names_its_folder_after():
    from bcp_megatron.saving import iteration_of

    assert iteration_of("/runs/gpt/iter_0000100") == iteration_of("/runs/gpt/iter_0000100/") == 100
    assert iteration_of("s3://bucket/gpt/iter_0000007") == 7
    assert iteration_of("/runs/gpt/ckpt") is None and iteration_of("/runs/iter_0000100/extra") is None
