"""bcp.save/bcp.load with the gRPC coordinator on real ranks: bitwise round trips and reshards, and
the same plan (manifest and shard table) as the torch.distributed coordinator makes."""

from __future__ import annotations

import os

import bcp
from bcp.coord.grpc import GrpcCoordinator
from models import assert_bitwise, build, full_state, rank, read_manifest, train


def tree_coordinator() -> GrpcCoordinator:
    """One machine per rank and two children per leader: a tree even on a few ranks."""
    return GrpcCoordinator(timeout=60, ranks_per_machine=1, fan_out=2)


def save_case(kind: str, path: str, transport: str, async_save: bool = False) -> dict | None:
    model, optimizer = build(kind, seed=1)
    train(model, optimizer, range(2))
    state = {"model": model, "optimizer": optimizer, "extra_state": {"rank": rank()}}
    if transport == "torch":
        bcp.save(path, state, coordinator=bcp.TorchCoordinator())
    else:
        with tree_coordinator() as coordinator:
            for _ in range(2):  # a second save reuses the channels (and, async, the sibling's)
                bcp.save(path, state, coordinator=coordinator, async_save=async_save).wait()
    full = full_state(model, optimizer)
    return full if rank() == 0 else None


def load_case(kind: str, path: str) -> dict | None:
    model, optimizer = build(kind, seed=2)
    state = {"model": model, "optimizer": optimizer, "extra_state": None}
    with tree_coordinator() as coordinator:
        bcp.load(path, state, coordinator=coordinator)
    full = full_state(model, optimizer)
    return {"state": full if rank() == 0 else None, "extra": state["extra_state"]}


def plan_of(path: str) -> tuple:
    """Everything a save's plan decided: files, every tensor's shards, every value's records."""
    m = read_manifest(path)
    return (m.world_size, m.files, {n: (e.dtype, e.shape, e.shards) for n, e in m.tensors.items()},
            {n: (o.records, o.ranks) for n, o in m.objects.items()})


def test_save_plans_match_the_torch_coordinators_and_load_reshards_bitwise(ranks, tmp_path):
    over_grpc, over_torch = str(tmp_path / "grpc"), str(tmp_path / "torch")
    saved = ranks(4).run(save_case, "fsdp2", over_grpc, "grpc")[0]
    ranks(4).run(save_case, "fsdp2", over_torch, "torch")
    assert plan_of(over_grpc) == plan_of(over_torch)
    loaded = ranks(2).run(load_case, "fsdp2", over_grpc)
    assert_bitwise(saved, loaded[0]["state"])
    assert [r["extra"] for r in loaded] == [{"rank": 0}, {"rank": 1}]


def test_async_saves_over_grpc_load_into_another_layout_bitwise(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks(2).run(save_case, "ddp", path, "grpc", True)[0]
    loaded = ranks(4).run(load_case, "fsdp2", path)
    assert_bitwise(saved, loaded[0]["state"])


def named_case() -> list:
    """``BCP_COORDINATOR=grpc``: the default coordinator is this job's gRPC one, made once."""
    os.environ["BCP_COORDINATOR"] = "grpc"
    try:
        first, second = bcp.coord.default_coordinator(), bcp.coord.as_coordinator("grpc")
        gathered = first.all_gather_bytes(bytes([rank()]))
    finally:
        del os.environ["BCP_COORDINATOR"]
    return [type(first).__name__, first is second, gathered, bcp.coord.default_coordinator() is first]


def test_the_grpc_coordinator_is_selected_by_name_or_environment_and_reused(ranks):
    for result in ranks(2).run(named_case):
        assert result == ["GrpcCoordinator", True, [b"\x00", b"\x01"], False]
