"""The random number generators of one process, as a value bcp saves per rank.

The Trainer saves them in ``rng_state_<rank>.pth`` (Python, NumPy, torch's CPU generator and the
accelerator's); here they are one per-rank value. A process beyond the number that saved keeps its
own generators, as the Trainer's engine does when it finds no file for that process.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore(states: dict[str, Any]) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(states["numpy"]))
    torch.random.set_rng_state(states["cpu"])
    saved_devices = states.get("cuda") or []
    if torch.cuda.is_available() and len(saved_devices) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(saved_devices)
