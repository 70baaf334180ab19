"""Interleaved save/load rounds: each repetition runs every method once, in a rotating order, and
each method saves, then loads (cold: files evicted from the page cache first; warm: right after),
then deletes its files. An untimed warm-up round first checks every load bit for bit."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bcpbench import disk
from bcpbench.record import Record, rotated, timed

Tensors = dict[str, torch.Tensor]


@dataclass
class Group:
    """The processes of a case: rank 0 records; ``barrier`` lines them up around every timing."""

    rank: int = 0
    barrier: Callable[[], None] = lambda: None

    @property
    def is_root(self) -> bool:
        return self.rank == 0


@dataclass
class Load:
    case: str
    run: Callable[[str], Any]  # checkpoint path -> the tensors loaded (checked when ``expected``)
    cold: bool = True
    root_only: bool = False  # a load by one process (the other ranks wait)
    #: What the loaded tensors (their local parts) must equal; checked in the warm-up round,
    #: after ``reset`` cleared the destination.
    expected: Tensors | None = None
    reset: Callable[[], None] | None = None
    method: str | None = None  # recorded under this name rather than the entry's (a variant's load)


@dataclass
class Entry:
    name: str
    save: Callable[[str], None] | None  # None: a floor with loads only (e.g. a memcpy)
    loads: list[Load] = field(default_factory=list)
    after_save: Callable[[int], None] | None = None  # gets the repetition (-1: warm-up)


def run_rounds(record: Record, entries: list[Entry], save_case: str | None, workdir: str, reps: int,
               group: Group) -> None:
    """Every repetition saves and loads with every entry; saves are recorded under ``save_case``
    (None: not recorded, where the saves only make the files that the loads read)."""
    for rep in range(-1, reps):
        for entry in rotated(entries, max(rep, 0)):
            path = os.path.join(workdir, f"{slug(entry.name)}-{rep + 1}")
            if entry.save is not None:
                seconds, _ = timed(functools.partial(entry.save, path), group.barrier)
                if rep >= 0 and group.is_root and save_case is not None:
                    record.add(save_case, entry.name, seconds)
                if entry.after_save is not None:
                    entry.after_save(rep)
            for load in entry.loads:
                _run_load(record, entry.name, load, path, rep, group)
            group.barrier()
            if group.is_root:
                disk.remove(path)
            group.barrier()


def _run_load(record: Record, method: str, load: Load, path: str, rep: int, group: Group) -> None:
    loads_here = group.is_root or not load.root_only
    check = rep < 0 and load.expected is not None and loads_here
    if check and load.reset is not None:
        load.reset()
    if load.cold and group.is_root:
        disk.evict(path)
    run = (lambda: load.run(path)) if loads_here else (lambda: None)
    if load.root_only:  # timed where it runs; the other processes wait at the barriers
        group.barrier()
        seconds, loaded = timed(run)
        group.barrier()
    else:
        seconds, loaded = timed(run, group.barrier)
    method = load.method or method
    if check:
        assert_equal(loaded, load.expected, f"{method}, {load.case}")
    if rep >= 0 and group.is_root:
        record.add(load.case, method, seconds)


def saving(method: Any, state: Tensors) -> Callable[[str], None]:
    """An entry's save: ``method.save(path, state)``."""
    return lambda path: method.save(path, state)


def keep_phases(record: Record, label: str, method: Any, group: Group) -> Callable[[int], None]:
    """An entry's ``after_save`` keeping a bcp save's per-phase seconds (timed repetitions, rank 0)."""
    def keep(rep: int) -> None:
        if rep >= 0 and method.last_save is not None and group.is_root:
            record.append(f"bcp save phases, {label}", method.last_save.seconds)
    return keep


def assert_equal(loaded: Tensors, expected: Tensors, what: str) -> None:
    for name, want in expected.items():
        got = loaded[name]
        got = got.to_local() if hasattr(got, "to_local") else got
        if not torch.equal(got, want):
            raise AssertionError(f"{what}: {name} differs from what was saved")


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
