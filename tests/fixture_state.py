"""The state stored in every format-version fixture (tests/fixtures/format-v*/)."""

from __future__ import annotations

import torch


def fixture_state() -> dict:
    return {
        "model": {
            "weight": torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7,
            "half": torch.arange(5, dtype=torch.bfloat16),
            "flags": torch.tensor([True, False, True]),
            "count": torch.tensor(11, dtype=torch.int64),
        },
        "extra_state": {"step": 42, "name": "fixture", "pair": (1.5, None), "blob": b"\x00\x01"},
    }


def empty_like_fixture() -> dict:
    state = fixture_state()
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    state["extra_state"] = None
    return state
