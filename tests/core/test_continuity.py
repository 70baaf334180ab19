"""Training continuity: train N steps, save, resume and train M more. Same layout: the losses are
identical to an uninterrupted N+M run; another layout: equal to floating-point tolerance."""

from __future__ import annotations

import pytest

import bcp
from models import build, train

N, M = 3, 4


def uninterrupted(kind: str, path: str) -> list[float]:
    model, optimizer = build(kind, seed=1)
    train(model, optimizer, range(N))
    bcp.save(path, {"model": model, "optimizer": optimizer, "extra_state": {"step": N}})
    return train(model, optimizer, range(N, N + M))


def resumed(kind: str, path: str) -> list[float]:
    model, optimizer = build(kind, seed=99, lr=0.5)
    state = {"model": model, "optimizer": optimizer, "extra_state": None}
    bcp.load(path, state)
    step = state["extra_state"]["step"]
    return train(model, optimizer, range(step, step + M))


def run(ranks, kind, world, fn, path):
    return fn(kind, path) if world == 1 else ranks(world).run(fn, kind, path)[0]


@pytest.mark.parametrize("kind,world", [("fsdp2", 2), ("ddp", 2), ("tp", 2), ("plain", 1)])
def test_same_layout_resume_is_identical(ranks, tmp_path, kind, world):
    expected = run(ranks, kind, world, uninterrupted, str(tmp_path))
    assert run(ranks, kind, world, resumed, str(tmp_path)) == expected


@pytest.mark.parametrize("src,src_world,dst,dst_world", [("fsdp2", 2, "plain", 1), ("ddp", 2, "fsdp2", 3),
                                                         ("fsdp2", 2, "tp", 2)])
def test_other_layout_resume_is_close(ranks, tmp_path, src, src_world, dst, dst_world):
    expected = run(ranks, src, src_world, uninterrupted, str(tmp_path))
    got = run(ranks, dst, dst_world, resumed, str(tmp_path))
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)
