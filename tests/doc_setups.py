"""What the docs' code blocks take as given (``<!-- doc-test: given tests/doc_setups.py::NAME -->``,
see ``doc_blocks``): each function makes, in ``folder``, the names its block uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import bcp
from models import MLP


def plain_training(folder: Path) -> dict[str, Any]:
    """A model, its optimizer after one step, and the step count."""
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 12)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "step": 1}


def one_rank_of_a_3d_job(folder: Path) -> dict[str, Any]:
    """A checkpoint path and state, and this process's coordinates (one process: all zero)."""
    return {"path": str(folder / "ckpt"), "state": {"model": MLP()}, "pp_rank": 0, "dp_rank": 0, "tp_rank": 0,
            "bcp": bcp}
