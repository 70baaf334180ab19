"""FSDP1 flat parameters are saved from each rank's local flat shard, and loaded into it, with no
collective besides planning (a load never calls the model's ``state_dict()``, which all-gathers
under FSDP1), and training resumes from them (its resharding layouts are in test_resharding.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import bcp
from models import build, train

COLLECTIVES = ["all_gather", "all_gather_into_tensor", "_all_gather_base", "all_reduce", "broadcast",
               "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter", "gather", "scatter",
               "all_to_all", "all_to_all_single", "barrier", "send", "recv"]


def count_collectives(path: str, operation: str) -> list[str]:
    """Every torch.distributed collective issued while bcp saves an FSDP1 model (``operation``
    "save") or loads the saved one into it ("load"), after one barrier of the test's own (bcp plans
    on a gloo group of its own, outside torch.distributed's functions)."""
    model, optimizer = build("fsdp1", seed=1)
    train(model, optimizer, range(2))
    coordinator = bcp.TorchCoordinator()
    if operation == "load":
        bcp.save(path, {"model": model, "optimizer": optimizer}, coordinator=coordinator)
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    try:
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        dist.barrier()
        getattr(bcp, operation)(path, {"model": model, "optimizer": optimizer}, coordinator=coordinator)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return calls


@pytest.mark.parametrize("operation", ["save", "load"])
def test_fsdp1_saves_and_loads_run_no_collective_besides_planning(ranks, tmp_path, operation):
    for calls in ranks(2).run(count_collectives, str(tmp_path / "ckpt"), operation):
        assert calls == ["barrier"], "the counter must see the test's barrier and nothing else"


N, M = 3, 3


def continuity(kind: str, path: str, resume: bool) -> list[float]:
    model, optimizer = build(kind, seed=99 if resume else 1)
    if resume:
        bcp.load(path, {"model": model, "optimizer": optimizer})
    else:
        train(model, optimizer, range(N))
        bcp.save(path, {"model": model, "optimizer": optimizer})
    return train(model, optimizer, range(N, N + M))


def test_fsdp1_resume_same_layout_is_exact_and_into_fsdp2_is_close(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    expected = ranks(2).run(continuity, "fsdp1", path, False)[0]
    assert ranks(2).run(continuity, "fsdp1", path, True)[0] == expected
    assert ranks(2).run(continuity, "fsdp2", path, True)[0] == pytest.approx(expected, rel=1e-4, abs=1e-6)
