"""The states stored in the format fixtures (tests/fixtures/format-v*/)."""

from __future__ import annotations

import torch


def fixture_state(version: int) -> dict:
    """The state of fixture ``format-v<version>``: version 2 adds tensors held outside the model (a
    dict of tensors, a bare tensor), which that version saves as tensors of their own; version 4
    tensors large enough to compress (in byte planes, as whole bytes) beside chunks stored raw."""
    state = {
        "model": {
            "weight": torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7,
            "half": torch.arange(5, dtype=torch.bfloat16),
            "flags": torch.tensor([True, False, True]),
            "count": torch.tensor(11, dtype=torch.int64),
        },
        "extra_state": {"step": 42, "name": "fixture", "pair": (1.5, None), "blob": b"\x00\x01"},
    }
    if version >= 2:
        state["ema"] = {"weight": torch.arange(24, dtype=torch.float32).reshape(4, 6) / 9, "decay": 0.99,
                        "history": [torch.tensor([1, 2], dtype=torch.int32), "kept"]}
        state["rng"] = torch.arange(8, dtype=torch.uint8)
    if version >= 4:
        state["model"]["wide"] = (torch.arange(4096) % 61 / 64).to(torch.bfloat16)
        state["model"]["ids"] = torch.arange(2048, dtype=torch.int64) % 10
    return state


def fixture_saves(version: int) -> list[dict]:
    """The saves that wrote fixture ``format-v<version>``, the last one's state being
    :func:`fixture_state`'s. Version 3 is an incremental save after one whose ``model/weight``
    differed: its manifest lists the first generation's data file for every other tensor. Version 4
    is one compressed save."""
    if version != 3:
        return [fixture_state(version)]
    earlier = fixture_state(version)
    earlier["model"] = dict(earlier["model"], weight=torch.zeros(4, 6))
    return [earlier, fixture_state(version)]


def empty_like_fixture(version: int) -> dict:
    """Live objects to load fixture ``format-v<version>`` into: tensors zeroed, values emptied."""
    state = fixture_state(version)
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    state["extra_state"] = None
    if version >= 2:
        state["ema"] = {"weight": torch.zeros(4, 6), "decay": 0.0, "history": [torch.zeros(2, dtype=torch.int32), ""]}
        state["rng"] = torch.zeros(8, dtype=torch.uint8)
    return state


def tensors_in_values_state() -> dict:
    """The state of fixture ``format-v1-tensors-in-values``, saved by bcp before tensors held by
    values were saved as tensors of their own (each value a record holding its tensors)."""
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"weight": torch.randn(3, 4, generator=g)},
        "ema": {"weight": torch.randn(3, 4, generator=g), "decay": 0.999, "steps": [torch.tensor(5), "x"]},
        "rng": torch.arange(6, dtype=torch.uint8),
        "extra_state": {"step": 9},
    }
