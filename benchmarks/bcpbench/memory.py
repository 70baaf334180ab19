"""Host memory over consecutive async saves, in a fresh process: each save is followed by a
"training step" that changes every tensor in place while earlier saves may still be writing. The
step negates the tensors (exact), so the last checkpoint is checked against the state at the end."""

from __future__ import annotations

import os
from typing import Any

import bcp
import torch

from bcpbench.record import Record, timed
from bcpbench.state import gpt_shapes, random_state, state_nbytes, zeros_in_one_block


def run(config: dict[str, Any]) -> dict:
    record = Record()
    shapes = gpt_shapes(config["size_bytes"])
    state = random_state(shapes, seed=3)
    path = os.path.join(config["workdir"], "memory")
    reset_peak = reset_peak_rss()
    baseline = rss_bytes()
    blocking, after_call, handles = [], [], []
    total, _ = timed(lambda: _save_and_step(path, state, config["saves"], blocking, after_call, handles))
    for handle in handles:
        handle.wait()
    peak = peak_rss_bytes() if reset_peak else None
    _, dest = zeros_in_one_block(shapes)
    bcp.load(path, {"model": dest})
    # The last save saw the state one negation before its current value.
    if not all(torch.equal(dest[n], -t) for n, t in state.items()):
        raise AssertionError("the last async save does not hold the state as of its call")
    record.figures["memory"] = {
        "state_bytes": state_nbytes(state), "saves": config["saves"], "baseline_rss": baseline,
        "rss_after_each_call": after_call, "peak_rss": peak, "blocking_seconds": blocking, "total_seconds": total,
    }
    return record.to_dict()


def _save_and_step(path: str, state: dict[str, torch.Tensor], saves: int, blocking: list, after_call: list,
                   handles: list) -> None:
    for _ in range(saves):
        seconds, handle = timed(lambda: bcp.save(path, {"model": state}, async_save=True))
        blocking.append(seconds)
        after_call.append(rss_bytes())
        handles.append(handle)
        for tensor in state.values():
            tensor.neg_()


def rss_bytes() -> int:
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (since the last reset)."""
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def reset_peak_rss() -> bool:
    """Start VmHWM (peak RSS) from now: the state's creation allocated temporaries."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
