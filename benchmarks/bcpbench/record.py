"""Measurements as plain data (workers send them back as JSON): timed samples per case and method,
the bytes each case moves, and single figures; plus the timer and the interleaving order."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Record:
    def __init__(self, data: dict[str, Any] | None = None) -> None:
        data = data or {}
        #: case -> method -> seconds of each repetition
        self.samples: dict[str, dict[str, list[float]]] = data.get("samples", {})
        #: case -> bytes of state the case moves (per process group, not per rank)
        self.nbytes: dict[str, int] = data.get("nbytes", {})
        #: name -> a figure or a list of them (e.g. per-phase seconds, memory series)
        self.figures: dict[str, Any] = data.get("figures", {})

    def add(self, case: str, method: str, seconds: float) -> None:
        self.samples.setdefault(case, {}).setdefault(method, []).append(seconds)

    def append(self, figure: str, value: Any) -> None:
        self.figures.setdefault(figure, []).append(value)

    def median(self, case: str, method: str) -> float | None:
        values = self.samples.get(case, {}).get(method)
        return statistics.median(values) if values else None

    def merge(self, other: Record) -> None:
        for case, methods in other.samples.items():
            for method, values in methods.items():
                self.samples.setdefault(case, {}).setdefault(method, []).extend(values)
        self.nbytes.update(other.nbytes)
        self.figures.update(other.figures)

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "nbytes": self.nbytes, "figures": self.figures}


def timed(fn: Callable[[], T], sync: Callable[[], None] = lambda: None) -> tuple[float, T]:
    """Seconds taken by ``fn`` and its result; ``sync`` (a barrier) runs before and after, so a
    multi-process operation is timed from the last rank's start to the last rank's end."""
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def rotated(items: list[T], rep: int) -> list[T]:
    """Repetition ``rep``'s order: each method moves one place earlier per repetition, so no
    method always runs first (cold machine) or right after a heavy writer (busy disk)."""
    k = rep % len(items) if items else 0
    return items[k:] + items[:k]
