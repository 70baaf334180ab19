"""The reader API: one tensor, or a slice of one, from a checkpoint saved by 2 FSDP2 ranks, reading
only the saved shards the request overlaps."""

from __future__ import annotations

import shutil

import pytest
import torch

import bcp
from bcp.tools import open_checkpoint, read_tensor
from models import build, full_state, rank, train


def save_fsdp2(path: str) -> dict | None:
    model, optimizer = build("fsdp2", seed=1)
    train(model, optimizer, range(2))
    bcp.save(path, {"model": model, "optimizer": optimizer, "extra_state": {"rank": rank()}})
    state = full_state(model, optimizer)  # collective: every rank gathers
    # full_state names optimizer tensors optimizer/<fqn>/<key>; the checkpoint, optimizer/state/<fqn>/<key>.
    return {name.replace("optimizer/", "optimizer/state/", 1): t for name, t in state.items()} if rank() == 0 else None


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("read") / "ckpt")
    return path, ranks(2).run(save_fsdp2, path)[0]


def test_every_tensor_reads_back_whole_and_bitwise(saved):
    path, state = saved
    checkpoint = open_checkpoint(path)
    assert set(checkpoint.tensors) == set(state)
    for name, expected in state.items():
        actual = checkpoint.read(name)
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), name


@pytest.mark.parametrize("index", [
    (slice(5, 15), 3), (slice(None, None, 4),), (Ellipsis, -1), 7, (slice(2, 20, 5), slice(1, 12, 2)),
    (slice(9, 9),), (), (-22, slice(-3, None)), (torch.tensor(4), Ellipsis),
])
def test_a_slice_equals_tensor_indexing(saved, index):
    path, state = saved
    expected = state["model/fc1.weight"][index]
    actual = read_tensor(path, "model/fc1.weight", index)
    assert actual.shape == expected.shape and torch.equal(actual, expected)
    assert actual.is_contiguous()


def test_a_slice_reads_only_the_shards_it_overlaps(saved):
    path, state = saved
    checkpoint = open_checkpoint(path)
    entry = checkpoint.tensors["model/fc1.weight"]
    assert len(entry.shards) == 2  # FSDP2 cut dim 0 between the ranks
    first_shard = next(s for s in entry.shards if s.box.offsets[0] == 0)

    assert torch.equal(checkpoint.read("model/fc1.weight", slice(0, 3)), state["model/fc1.weight"][:3])
    assert checkpoint.bytes_read == first_shard.bytes.nbytes  # the other shard was not read


def test_zero_dim_tensors_and_values(saved):
    path, state = saved
    checkpoint = open_checkpoint(path)
    step = checkpoint.read("optimizer/state/fc1.weight/step")
    assert step.shape == () and torch.equal(step, state["optimizer/state/fc1.weight/step"])
    assert checkpoint.read_object("extra_state", rank=1) == {"rank": 1}


def test_reading_errors_say_what_is_wrong(saved):
    checkpoint = open_checkpoint(saved[0])
    with pytest.raises(bcp.CheckpointError, match="did you mean 'model/fc1.weight'"):
        checkpoint.read("model/fc1.weihgt")
    with pytest.raises(bcp.CheckpointError, match="non-tensor value: use read_object"):
        checkpoint.read("extra_state")
    with pytest.raises(bcp.CheckpointError, match="rank 2 saved no value"):
        checkpoint.read_object("extra_state", rank=2)
    with pytest.raises(IndexError, match="out of bounds for dimension 0 with size 22"):
        checkpoint.read("model/fc1.weight", 22)
    with pytest.raises(IndexError, match="too many indices"):
        checkpoint.read("model/fc1.weight", (0, 0, 0))
    with pytest.raises(IndexError, match="positive slice steps"):
        checkpoint.read("model/fc1.weight", slice(None, None, -1))
    with pytest.raises(TypeError, match="unsupported index"):
        checkpoint.read("model/fc1.weight", [0, 1])


def test_opening_picks_the_newest_committed_generation(saved, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], path)
    shutil.copytree(f"{path}/gen-00000001", f"{path}/gen-00000002", ignore=shutil.ignore_patterns("COMMITTED"))

    checkpoint = open_checkpoint(path)
    assert checkpoint.generation == 1
    assert checkpoint.generations() == [(1, True), (2, False)]
    with pytest.raises(bcp.CheckpointNotCommittedError, match="never committed"):
        open_checkpoint(path, generation=2)
    with pytest.raises(bcp.CheckpointNotFoundError, match=r"no generation 5 \(gen-00000005\); the committed generations kept are \[1\]"):
        open_checkpoint(path, generation=5)
    with pytest.raises(bcp.CheckpointNotFoundError, match="no such checkpoint path"):
        open_checkpoint(tmp_path / "nowhere")
