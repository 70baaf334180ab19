"""A cold load with bcp's defaults (verification and transactional staging) next to the disk's floor
read into the same live tensors, on states held as plain dicts of tensors of their own storage: a
few large tensors (15, the largest about 30% of the bytes) and the GPT-like state of about 100
tensors. One process; the staging buffers are reused from load to load (the untimed warm-up round
allocates them), as a process that loads repeatedly finds them. Each bcp load's own phases are kept,
so the report says what share of the load placing the staged bytes (``apply``) takes.

The methods run in interleaved rounds (raw, bcp, raw, bcp, ... in a rotating order), at least
``MIN_ROUNDS`` of them: on a shared disk a cold read's time moves by tens of percent from minute to
minute, so the figure judged is the median over rounds of each round's own ratio (the raw read's
seconds over the load's, both read within seconds of each other), shown with its spread."""

from __future__ import annotations

import os
import statistics
from typing import Any

import bcp
import torch

from bcp.engine.bytes_of import byte_view
from bcpbench import disk
from bcpbench.record import Record
from bcpbench.rounds import Entry, Group, Load, run_rounds, saving
from bcpbench.state import gpt_shapes, random_state, state_nbytes

LARGE = "load cold, a few large tensors in a plain dict, 1 process"
MANY = "load cold, GPT-like state of many tensors in a plain dict, 1 process"
CASES = (LARGE, MANY)
RAW, BCP, IN_PLACE = "raw read into the live tensors, 4 threads", "bcp", "bcp, load with transactional=False"
PHASES = "bcp load phases, "  # + case: the timed default loads' phase seconds
# MB of each tensor of the few-large state, scaled to the run's size: the largest holds 29% of the bytes
LARGE_SHARES = (262, 160, 120, 80, 64, 48, 40, 32, 24, 20, 16, 12, 8, 4, 2)
ONE = Group()
# Rounds at least (whatever the profile's repetitions): one cold read of the same 0.9 GB took from
# 0.26 to 1.3 s here while other programs used the disk, so a median wants more than a few.
MIN_ROUNDS = 9


def run(config: dict[str, Any]) -> dict:
    record = Record()
    total = config["cold_floor_bytes"]
    scale = total / (sum(LARGE_SHARES) << 20)
    states = {LARGE: lambda: {f"w{i}": torch.rand(int(mb * scale * (1 << 20)) // 4, generator=_seeded(i))
                              for i, mb in enumerate(LARGE_SHARES)},
              MANY: lambda: random_state(gpt_shapes(total), seed=3)}
    for case, make in states.items():
        state = make()
        record.nbytes[case] = state_nbytes(state)
        _measure(record, case, state, config)
        del state
    return record.to_dict()


def _measure(record: Record, case: str, state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    io = config["io_threads"]
    live = {name: torch.zeros_like(tensor) for name, tensor in state.items()}  # touched: no page faults timed
    raw, loader, in_place = RawIntoLive(io), Loading(io, True), Loading(io, False)
    reset = lambda: [tensor.zero_() for tensor in live.values()]  # noqa: E731 - a one-line callback
    entries = [Entry(RAW, saving(raw, state), [Load(case, lambda p: raw.read(p, live))]),
               Entry(BCP, saving(loader, state),
                     [Load(case, lambda p: loader.load(p, live), expected=state, reset=reset),
                      Load(case, lambda p: in_place.load(p, live), expected=state, reset=reset, method=IN_PLACE)])]
    run_rounds(record, entries, None, config["workdir"], max(config["reps"], MIN_ROUNDS), ONE)
    record.figures[PHASES + case] = loader.phases[1:]  # the warm-up round's load left out


class RawIntoLive:
    """The floor: the tensors' bytes as-is in ``threads`` files (fsync'd), read back with one thread
    per file straight into the live tensors' memory."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def save(self, path: str, state: dict[str, torch.Tensor]) -> None:
        disk.raw_write(path, list(state.values()), self.threads)

    def read(self, path: str, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        bins = disk.balanced_bins(list(live.values()), self.threads)  # the order the save wrote them in
        files = [os.path.join(path, f"raw-{i}.bin") for i in range(len(bins))]
        disk.read_files_into(files, [[byte_view(t) for t in tensors] for tensors in bins])
        return live


class Loading:
    """``bcp.load`` of a plain dict with bcp's defaults (or ``transactional=False``), keeping each
    load's phase seconds."""

    def __init__(self, io_threads: int, transactional: bool) -> None:
        self.io_threads, self.transactional = io_threads, transactional
        self.phases: list[dict[str, float]] = []

    def save(self, path: str, state: dict[str, torch.Tensor]) -> None:
        bcp.save(path, state, io_threads=self.io_threads)

    def load(self, path: str, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        result = bcp.load(path, live, io_threads=self.io_threads, transactional=self.transactional)
        self.phases.append(result.stats.seconds)
        return live


def paired_ratios(record: Record, case: str, method: str = BCP) -> list[float]:
    """Each round's raw read seconds over ``method``'s load seconds in that round (the samples are
    kept in round order)."""
    methods = record.samples.get(case, {})
    return [raw / load for raw, load in zip(methods.get(RAW, []), methods.get(method, []))]


def paired_ratio(record: Record, case: str, method: str = BCP) -> float | None:
    """The median over rounds of ``paired_ratios``: the load's speed against the raw read's."""
    ratios = paired_ratios(record, case, method)
    return statistics.median(ratios) if ratios else None


def apply_share(record: Record, case: str) -> float | None:
    """The median over the timed default loads of ``apply`` seconds / the load's seconds."""
    phases, times = record.figures.get(PHASES + case), record.samples.get(case, {}).get(BCP)
    if not phases or not times or len(phases) != len(times):
        return None
    return statistics.median(p.get("apply", 0.0) / t for p, t in zip(phases, times))


def report_lines(record: Record) -> list[str]:
    """The cases' tables, each with the median phases of bcp's default load."""
    cases = [case for case in CASES if case in record.samples]
    if not cases:
        return []
    lines = ["Cold loads into live tensors of their own storage (plain dicts), one process, the staging buffers "
             "reused: bcp with its defaults (verification, transactional staging), with `transactional=False`, "
             "and the raw read of the same bytes into the same tensors (one thread per file, 4 files). "
             "`apply` = placing the staged bytes into the live tensors (an exchange of memory where the "
             "live storage allows it, else a copy). Interleaved rounds; `vs raw read` is the median over "
             "rounds of each round's raw seconds / the method's seconds, [lowest, highest] beside it.", ""]
    for case in cases:
        nbytes, floor = record.nbytes.get(case), record.median(case, RAW)
        lines += [f"### {case}, {nbytes / 1e6:.0f} MB" if nbytes else f"### {case}", "",
                  "| method | rounds | median s | GB/s | vs raw read | spread s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for method, values in record.samples[case].items():
            t, ratios = statistics.median(values), paired_ratios(record, case, method)
            versus = (f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"
                      if ratios and method != RAW else "-")
            lines.append(f"| {method} | {len(values)} | {t:.4g} | {nbytes / t / 1e9:.2f} | {versus} | "
                         f"[{min(values):.3g}, {max(values):.3g}] |" if nbytes and floor else
                         f"| {method} | {len(values)} | {t:.4g} | - | - | [{min(values):.3g}, {max(values):.3g}] |")
        phases = record.figures.get(PHASES + case) or []
        if phases:
            medians = {key: statistics.median(p.get(key, 0.0) for p in phases)
                       for key in ("metadata", "plan", "read", "agree", "apply", "confirm")}
            share = apply_share(record, case)
            lines += ["", "bcp's default load, median phase seconds: " + ", ".join(
                f"{key} {value:.4f}" for key, value in medians.items())
                + ("" if share is None else f"; apply {share:.1%} of the load")]
        lines.append("")
    return lines


def _seeded(index: int) -> torch.Generator:
    return torch.Generator().manual_seed(4_000_037 + index)
