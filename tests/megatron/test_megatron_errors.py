"""Megatron's contract on errors, on 2 gloo ranks with real Megatron-Core objects: what Megatron-Core's
own ``test_load_error_msg`` and ``test_tensor_shape_mismatch`` (tests/unit_tests/dist_checkpointing/
test_serialization.py at core_v0.16.1) check, with bcp as the sharded backend. Those tests catch
``megatron.core.dist_checkpointing.core.CheckpointingException``; bcp's errors must be that and stay
``bcp.CheckpointError`` s. Upstream runs the shape case at TP=2 x PP=4 on 8 ranks; here TP=2 on 2
ranks, which gives the same smaller-than-saved and larger-than-saved requests. As upstream, the
saved tensor is int64 and the requests float32: Megatron's contract (torch_dist) casts, and so does
bcp's load strategy (``cast_dtype``, on there; off in ``bcp.load``).

Also Megatron's ``common.pt`` in a bcp checkpoint: read with ``weights_only=True``, so a pickle that
would run code is refused with ``bcp.UnsafeCheckpointError`` and runs nothing."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import bcp_megatron  # noqa: F401  (registers the ('bcp', 1) backend)
from hostile_pickle import TouchesMarker
from megatron_parts import parallel, raised


def load_error_messages(root: str) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor, load, save

    rank = dist.get_rank()
    with parallel():
        sh_ten = ShardedTensor.from_rank_offsets("keyA", torch.rand(10), replica_id=rank)
        state_dict = {"some_key": sh_ten}
        missing = os.path.join(root, "non-existent")
        empty = os.path.join(root, "ckpt")
        outcomes = {"missing": raised(lambda: load(state_dict, missing))}
        if rank == 0:
            os.makedirs(empty)
        dist.barrier()
        outcomes["empty"] = raised(lambda: load(state_dict, empty))
        save(state_dict, empty, sharded_strategy=("bcp", 1))
        sh_ten.key = "different_key"
        outcomes["renamed"] = raised(lambda: load(state_dict, empty))
    return outcomes


def test_load_error_messages_are_megatron_exceptions(ranks, tmp_path):
    for outcome in ranks(2).run(load_error_messages, str(tmp_path)):
        missing = os.path.join(tmp_path, "non-existent")
        assert outcome["missing"][0] is True and f"directory {missing} does not exist" in outcome["missing"][2]
        assert outcome["empty"][0] is True and "is not a distributed checkpoint" in outcome["empty"][2]
        is_megatron, bcp_class, message = outcome["renamed"]
        assert (is_megatron, bcp_class) == (True, "MismatchError")
        assert "different_key" in message and str(tmp_path / "ckpt") in message


def shape_mismatches(path: str) -> dict:
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor, load, save

    rank, world = dist.get_rank(), dist.get_world_size()
    with parallel(tp=2):
        # Global tensor: range(4 * world) repeated twice over the first dimension.
        local = torch.arange(4).unsqueeze(0).expand(2, 4) + rank * 4
        save({"rigid": ShardedTensor.from_rank_offsets("keyA", local, (1, rank, world)),
              "flexible": ShardedTensor.from_rank_offsets("keyB", local, (1, rank, world), allow_shape_mismatch=True)},
             path, sharded_strategy=("bcp", 1))
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()

        def request(key: str, width: int, **kwargs) -> dict:
            return {key: ShardedTensor.from_rank_offsets("keyA" if key == "rigid" else "keyB", torch.ones(2, width),
                                                         (1, pp_rank, pp_size), replica_id=tp_rank, **kwargs)}

        return {
            "smaller": raised(lambda: load(request("rigid", 7), path)),
            "larger": raised(lambda: load(request("rigid", 9), path)),
            "smaller flexible": load(request("flexible", 7, allow_shape_mismatch=True), path)["flexible"],
            "larger flexible": load(request("flexible", 9, allow_shape_mismatch=True), path)["flexible"],
        }


def test_tensor_shape_mismatch_is_a_megatron_exception(ranks, tmp_path):
    for outcome in ranks(2).run(shape_mismatches, str(tmp_path)):
        for case in ("smaller", "larger"):
            is_megatron, bcp_class, message = outcome[case]
            assert (is_megatron, bcp_class) == (True, "MismatchError"), outcome[case]
            assert "keyA" in message and str(tmp_path) in message
        assert torch.equal(outcome["smaller flexible"], torch.arange(7.0).unsqueeze(0).expand(2, 7))
        padded = torch.arange(9.0).unsqueeze(0).expand(2, 9).clone()
        padded[:, 8:] = 0  # the saved tensor is 8 wide
        assert torch.equal(outcome["larger flexible"], padded)


def common_state(path: str, marker: str) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor, load, save

    rank = dist.get_rank()
    common = os.path.join(path, "common.pt")
    with parallel():
        def state() -> dict:
            return {"iteration": 7, "args": argparse.Namespace(lr=0.5),
                    "w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0), replica_id=rank)}

        save(state(), path, sharded_strategy=("bcp", 1))
        loaded = load(state(), path)
        outcomes = {"loaded": (loaded["iteration"], loaded["args"], loaded["w"].tolist())}
        dist.barrier()
        if rank == 0:
            torch.save({"iteration": TouchesMarker(marker)}, common)
        dist.barrier()
        outcomes["hostile"] = raised(lambda: load(state(), path))
    return outcomes


def test_hostile_common_pt_is_refused_and_runs_nothing(ranks, tmp_path):
    marker = tmp_path / "marker"
    (tmp_path / "ckpt").mkdir()
    for outcome in ranks(2).run(common_state, str(tmp_path / "ckpt"), str(marker)):
        assert outcome["loaded"] == (7, argparse.Namespace(lr=0.5), [0.0, 1.0, 2.0, 3.0])
        is_megatron, bcp_class, message = outcome["hostile"]
        assert (is_megatron, bcp_class) == (True, "UnsafeCheckpointError"), outcome["hostile"]
        assert "common.pt" in message and "Unsupported global" in message and str(tmp_path / "ckpt") in message
    assert not marker.exists()
