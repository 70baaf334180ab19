"""Save in one layout, load into another, compare every tensor bitwise (multi-process, gloo)."""

from __future__ import annotations

import pytest

import bcp
from models import assert_bitwise, build, full_state, rank, train


def save_trained(kind: str, path: str, steps: int = 3) -> dict | None:
    model, optimizer = build(kind, seed=1)
    train(model, optimizer, range(steps))
    bcp.save(path, {"model": model, "optimizer": optimizer, "extra_state": {"rank": rank(), "step": steps}})
    state = full_state(model, optimizer)
    return state if rank() == 0 else None


def load_fresh(kind: str, path: str) -> dict:
    model, optimizer = build(kind, seed=2)
    state = {"model": model, "optimizer": optimizer, "extra_state": None}
    result = bcp.load(path, state)
    out = full_state(model, optimizer)
    return {"state": out if rank() == 0 else None, "extra": state["extra_state"],
            "from_rank0": result.from_rank0, "lr": optimizer.param_groups[0]["lr"]}


def run(ranks, kind: str, world: int, fn, *args):
    if world == 1 and kind == "plain":
        return [fn(kind, *args)]
    return ranks(world).run(fn, kind, *args)


LAYOUTS = [
    ("fsdp2", 2, "fsdp2", 3),
    ("fsdp2", 3, "fsdp2", 2),
    ("fsdp2", 2, "plain", 1),
    ("plain", 1, "fsdp2", 2),
    ("fsdp2", 2, "ddp", 2),
    ("ddp", 2, "fsdp2", 3),
    ("ddp", 2, "plain", 1),
    ("plain", 1, "ddp", 3),
    ("tp", 2, "fsdp2", 2),
    ("fsdp2", 3, "tp", 2),
    ("fsdp2", 2, "fsdp2", 4),
]


@pytest.mark.parametrize("src,src_world,dst,dst_world", LAYOUTS)
def test_model_and_optimizer_reshard_bitwise(ranks, tmp_path, src, src_world, dst, dst_world):
    path = str(tmp_path / "ckpt")
    saved = run(ranks, src, src_world, save_trained, path)[0]
    loaded = run(ranks, dst, dst_world, load_fresh, path)
    assert_bitwise(saved, loaded[0]["state"])
    for r, result in enumerate(loaded):
        assert result["lr"] == 1e-2
        expected_rank = r if r < src_world else 0
        assert result["extra"] == {"rank": expected_rank, "step": 3}
        assert result["from_rank0"] == ([] if r < src_world else ["extra_state"])
