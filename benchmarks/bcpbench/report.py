"""One run's record as Markdown, cut into named blocks, one per checkpoint path: how it was
measured, the targets, saves, loads, async saves, FSDP1 saves, per-tensor overhead and phases,
planning at scale, a save at every step, compression, and how to read a missed target. ``render``
joins every block into the run's results file; ``benchmarks/publish.py`` puts the same blocks into ``docs/benchmarks.md``."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bcpbench import distributed as d2
from bcpbench import cold_floor, compression_report, every_step, fsdp1, incremental
from bcpbench import single as d1
from bcpbench import tensor_path as tp
from bcpbench.methods import FIRST_SAVE
from bcpbench.record import Record
from bcpbench.targets import (
    BARE_COPY,
    DCP,
    MEMCPY,
    checks,
    floor_seconds,
    per_byte,
    per_tensor_ms,
    ratio,
    written_share,
)

SAVES = [d1.SAVE, d2.SAVE_SHARDED, d2.SAVE_COLUMNS, d2.SAVE_REPLICATED]
LOADS = [d1.COLD, d2.COLD_SAME, d2.LOAD_REPLICATED, d2.RESHARDED, d2.TO_ONE, d2.ROWS_FROM_COLUMNS, d1.WARM,
         d2.WARM_SAME]
ASYNC = [d1.ASYNC_BLOCK, d1.ASYNC_TOTAL]
FSDP1 = [fsdp1.BLOCKING, fsdp1.TOTAL]


def blocks(record: Record, run: dict[str, Any]) -> dict[str, tuple[str, list[str]]]:
    """Block name -> (its title, its Markdown lines); a block the run did not measure has no lines."""
    makers: dict[str, tuple[str, Callable[[], list[str]]]] = {
        "run": ("How this was measured", lambda: _run_facts(run)),
        "targets": ("Targets", lambda: _targets(record, run)),
        "save": ("Saving", lambda: _cases(record, SAVES)),
        "load": ("Loading", lambda: _cases(record, LOADS) + cold_floor.report_lines(record)),
        "async": ("Async save", lambda: _cases(record, ASYNC) + _memory(record)),
        "fsdp1": ("FSDP1 save", lambda: _cases(record, FSDP1) + _fsdp1_figures(record)),
        "tensors": ("Where the tensors are held", lambda: _tensor_path(record)),
        "overhead": ("Per-tensor overhead and phases", lambda: _per_tensor(record) + _phases(record)),
        "planning": ("Planning at scale", lambda: _planning_scale(run.get("planning_scale"))),
        "incremental": ("Incremental saves", lambda: incremental.report_lines(record)),
        "every-step": ("A save at every step", lambda: every_step.report_lines(record)),
        "compression": ("Compression", lambda: compression_report.report_lines(record)),
        "reading": ("Reading a missed target", _reading),
    }
    return {name: (title, make()) for name, (title, make) in makers.items()}


def render(record: Record, run: dict[str, Any], notes: list[str]) -> str:
    """The whole results file of one run."""
    lines = [f"# Benchmarks{' (quick run)' if run['profile'] == 'quick' else ''}", ""]
    lines += [f"> {note}" for note in notes] + ([""] if notes else [])
    for title, body in blocks(record, run).values():
        if body:
            lines += [f"## {title}", ""] + body
    return "\n".join(lines) + "\n"


def summary(record: Record, run: dict[str, Any]) -> str:
    """What a run prints at its end: the targets table."""
    return "\n".join(_targets(record, run))


def _targets(record: Record, run: dict[str, Any]) -> list[str]:
    lines = [("Ratios to what was measured in the same run. `x` = times as fast (bandwidth ratio), except in the "
              "rows of seconds per byte and of bytes written (lower is better); `%` and `ms` = as stated."), "",
             "| target | where | measured | goal | verdict |", "| --- | --- | --- | --- | --- |"]
    for c in checks(record, run.get("planning_scale")):
        measured = "not measured" if c.measured is None else f"{c.measured:.3g}{c.unit}"
        goal = f"{'>=' if c.at_least else '<='} {c.goal:g}{c.unit}"
        verdict = {True: "met", False: "**missed**", None: "-"}[c.met]
        lines.append(f"| {c.target} | {c.where} | {measured} | {goal} | {verdict} |")
    return lines + [""]


def _cases(record: Record, cases: list[str]) -> list[str]:
    return [line for case in cases if case in record.samples for line in _case_table(record, case)]


def _run_facts(run: dict[str, Any]) -> list[str]:
    m = run["machine"]
    return [f"- Command: `{run['command']}` ({run['started']}, {run['minutes']:.1f} min), code at "
            f"commit {run.get('commit', 'unknown')}.",
            (f"- State: GPT-like fp32 tensors, {run['state_mb']:.0f} MB, {run['tensors']} tensors; "
             f"{run['reps']} timed repetitions after one untimed warm-up round, interleaved (each repetition "
             "runs every method once, in a rotating order); medians reported, spread in brackets."),
            (f"- Machine: {m['cores']} cores, {m['ram_gb']:.0f} GB RAM, load average {m['load_before']} before and "
             f"{m['load_after']} after; disk free {m['disk_free_gb']:.0f} GB; torch threads: 1 process "
             f"{run['torch_threads_1p']}, 2 processes 1 each."),
            f"- Versions: {run['versions']}.",
            ("- Saves are durable: bcp and DCP fsync their files; torch.save and safetensors are followed by an "
             "fsync of their file. The raw floor writes the same bytes from tensor memory into 1 or "
             f"{run['io_threads']} files in parallel and fsyncs them; its faster median is the floor."),
            ("- Cold loads: every file is fsync'd, then dropped from the page cache "
             "(`posix_fadvise(POSIX_FADV_DONTNEED)`). Warm loads follow a cold load of the same files."),
            ("- Every load ends with the bytes in preallocated live tensors: bcp and DCP load in place; "
             "torch.load and safetensors' load_file (a memory map) are followed by a copy into them, as "
             "`load_state_dict` would do. `bcp, load with verify=False` skips checksum verification (bcp "
             "verifies by default), to show its cost; `bcp, load with transactional=False` reads straight "
             "into the live tensors instead of into staging memory placed once every byte is verified (bcp's "
             "default, so a failed load leaves the live state as it was), to show what staging costs (placing "
             "exchanges the staging memory with the live storage's where it allows it, else copies)."),
            ("- Columns: `vs floor` = the floor's median time / this median time (1.00x = as fast as the disk, "
             "or as a memcpy for warm loads and async blocking); `vs DCP` = DCP's median time / this one."),
            ("- Planning figures are the `plan` phase of bcp's own per-save stats (`handle.stats.seconds`): the "
             "comparison of each rank's structure key with its cached plan's, the exchange that agrees on "
             "reuse, and, when not cached, the local plans, their gather and the global plan. Turning the "
             "state into pieces (and their structure key) is the separate `collect` phase, which every save "
             "needs, cached or not."),
            (f"- `bcp` rows are steady-state saves (plan cached); `bcp, first save of the structure` plans anew. "
             f"DCP tuned = `FileSystemWriter(thread_count={run['dcp_threads']})`; bcp uses "
             f"`io_threads={run['io_threads']}`."), ""]


def _case_table(record: Record, case: str) -> list[str]:
    nbytes = record.nbytes.get(case)
    copy = record.median(case, MEMCPY) or record.median(case, BARE_COPY)
    reference = copy if copy is not None else floor_seconds(record, case)
    dcp_name = DCP if DCP in record.samples[case] else next((m for m in record.samples[case] if "DCP" in m), None)
    dcp = record.median(case, dcp_name) if dcp_name else None
    size = f", {nbytes / 1e6:.0f} MB" if nbytes else ""
    lines = [f"### {case}{size}", "", f"| method | median s | GB/s | vs floor | vs {dcp_name or 'DCP'} | spread s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for method, values in record.samples[case].items():
        t = statistics.median(values)
        bandwidth = f"{nbytes / t / 1e9:.2f}" if nbytes else "-"
        lines.append(f"| {method} | {t:.4g} | {bandwidth} | {_x(ratio(reference, t))} | {_x(ratio(dcp, t))} | "
                     f"[{min(values):.3g}, {max(values):.3g}] |")
    return lines + [""]


def _tensor_path(record: Record) -> list[str]:
    cases = [case for case in tp.CASES if case in record.samples]
    if not cases:
        return []
    lines = [(f"The same tensors held as {tp.MODULE} (`{{\"model\": m, \"optimizer\": opt}}`, AdamW after one step), "
              f"as {tp.DICT} and as {tp.TOP} (`dict(tensors)` as the state) on 1 process; on 2 processes "
              f"(gloo, DDP-replicated) as {tp.MODULE} and as {tp.EMA} (`{{\"model\": ddp, \"ema\": dict}}`, "
              "an EMA of the parameters). DCP and torch.save save the same tensors as one flat dict (on 2 "
              "processes those of (d); torch.save by rank 0). Every load fills live tensors of their own "
              "storage. `per byte vs (a)` = this method's seconds per byte / those of (a) in the same case "
              "(a time ratio: 1.00x = as fast per byte as the module and optimizer)."), ""]
    for case in cases:
        sizes = record.figures.get(tp.BYTES + case, {})
        dcp = record.median(case, DCP)
        lines += [f"### {case}", "",
                  "| method | MB per process | median s | GB/s | per byte vs (a) | vs DCP | spread s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for method, values in record.samples[case].items():
            t = statistics.median(values)
            nbytes = sizes.get(method, record.nbytes.get(case))
            mb = f"{nbytes / 1e6:.0f}" if nbytes else "-"
            bandwidth = f"{nbytes / t / 1e9:.2f}" if nbytes else "-"
            lines.append(f"| {method} | {mb} | {t:.4g} | {bandwidth} | {_x(per_byte(record, case, method))} | "
                         f"{_x(ratio(dcp, t))} | [{min(values):.3g}, {max(values):.3g}] |")
        lines.append("")
    return lines + _written(record)


def _written(record: Record) -> list[str]:
    written = record.figures.get(tp.WRITTEN)
    if not written:
        return []
    ranks = sorted({rank for by_rank in written.values() for rank in by_rank}, key=int)
    lines = [f"### {tp.WRITTEN}", "",
             "Data files only (bcp's `data/`, DCP's `.distcp`, torch.save's file); `vs the state` = all ranks' "
             "data bytes / the bytes of the state one process holds (1.00x: every byte written once).", "",
             "| method | " + " | ".join(f"rank {r} MB" for r in ranks) + " | vs the state |",
             "| --- | " + " | ".join("---" for _ in ranks) + " | --- |"]
    for method, by_rank in written.items():
        lines.append(f"| {method} | " + " | ".join(f"{by_rank.get(r, 0) / 1e6:.1f}" for r in ranks)
                     + f" | {_x(written_share(record, method))} |")
    return lines + [""]


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _per_tensor(record: Record) -> list[str]:
    workload = record.figures.get("per-tensor workload")
    if not workload:
        return []
    lines = ["### Per-tensor overhead", "",
             (f"{workload['tensors']} tensors of {workload['bytes_each']} bytes vs the same bytes as one tensor "
              "(1 process, files warm for loads): (median for many - median for one) / count."), "",
             "| method | save ms/tensor | load ms/tensor |", "| --- | --- | --- |"]
    for method in ("bcp", FIRST_SAVE, DCP):
        save = per_tensor_ms(record, "per-tensor: save", method)
        load = per_tensor_ms(record, "per-tensor: load warm", method)
        lines.append(f"| {method} | {_ms(save)} | {_ms(load)} |")
    return lines + [""]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _phases(record: Record) -> list[str]:
    keys = sorted(k for k in record.figures if k.startswith(("bcp save phases", "bcp load phases")))
    if not keys:
        return []
    lines = ["### bcp per-phase seconds (medians, rank 0)", "", "| what | phases |", "| --- | --- |"]
    for key in keys:
        value = record.figures[key]
        samples = value if isinstance(value, list) else [value]
        phases = {p: statistics.median(s[p] for s in samples if p in s) for p in samples[0]}
        lines.append(f"| {key} | " + ", ".join(f"{p} {s:.4g}" for p, s in phases.items()) + " |")
    return lines + [""]


def _fsdp1_figures(record: Record) -> list[str]:
    model = record.figures.get("fsdp1 model")
    if not model:
        return []
    state_dict = record.figures.get("DCP get_state_dict seconds, FSDP1 (rank 0)") or []
    lines = ["### FSDP1 notes", "",
             (f"Model: {fsdp1.BLOCKS} blocks, hidden {model['hidden']}, each block its own FSDP unit "
              f"(`use_orig_params=True`, FULL_SHARD), AdamW after one step: {model['saved_bytes'] / 1e6:.0f} MB "
              "of parameters and moments.")]
    if state_dict:
        lines.append(f"DCP's `get_state_dict` alone (FSDP's sharded state dict, which all-gathers): median "
                     f"{statistics.median(state_dict):.3g} s of its blocking time. bcp reads each rank's local "
                     "flat shards and issues no collective beyond its planning exchange.")
    return lines + [""]


def _memory(record: Record) -> list[str]:
    m = record.figures.get("memory")
    if not m:
        return []
    after = m["rss_after_each_call"]
    mb = 1e6
    lines = ["### Host memory over consecutive async saves", "",
             (f"{m['saves']} bcp async saves of a {m['state_bytes'] / mb:.0f} MB state in a fresh process, each "
              "followed by an in-place change of every tensor (no wait in between); the last checkpoint was "
              "checked against the state at its call."), "",
             "| figure | MB |", "| --- | --- |",
             f"| RSS before the first save (the state) | {m['baseline_rss'] / mb:.0f} |",
             (f"| RSS after save 1 / 2 / {m['saves']} returned | {after[0] / mb:.0f} / {after[1] / mb:.0f} / "
              f"{after[-1] / mb:.0f} |"),
             f"| growth from save 2 to save {m['saves']} | {(after[-1] - after[1]) / mb:+.0f} |"]
    if m["peak_rss"] is not None:
        lines.append(f"| peak RSS over the {m['saves']} saves | {m['peak_rss'] / mb:.0f} |")
    for key in sorted(k for k in record.figures if k.startswith("peak RSS of")):
        lines.append(f"| {key} | {record.figures[key] / mb:.0f} |")
    blocking = m["blocking_seconds"]
    lines += ["", (f"Blocking per call: median {statistics.median(blocking):.3g} s, max {max(blocking):.3g} s "
               "(a call waits while both host buffers are still being written); all "
               f"{m['saves']} committed after {m['total_seconds']:.3g} s."), ""]
    return lines


def _planning_scale(figures: dict | None) -> list[str]:
    if not figures:
        return []
    lines = [("`benchmarks/planning_scale.py`: the coordinator's work for a Llama-405B-shaped model on TP8 x "
              "PP16 x DP70 from shapes only, one process (targets: < 10 s coordinator total, < 2 s manifest "
              "parse)."), "",
             "| figure | value |", "| --- | --- |"]
    lines += [f"| {key} | {value} |" for key, value in figures.items()]
    return lines + [""]


def _reading() -> list[str]:
    return [("- Loads: compare `bcp` with `bcp, load with verify=False` (same files): the difference is the "
             "crc32c verification of every byte read, which bcp does by default; compare it with `bcp, load "
             "with transactional=False` for the cost of placing only verified bytes (staging memory, then an "
             "exchange of memory with the live storage, or a copy where the storage does not allow one); the "
             "per-phase table splits loads into metadata, plan, read and apply."),
            ("- Re-planning: the figure is bcp's whole `plan` phase of a save (the structure comparison and the "
             "agreement on reuse, plus the local and global plans when not cached). Its fixed part, one "
             "exchange between the ranks, dominates at this scale; the part a cache hit skips grows with "
             "the number of ranks and pieces. `planning_scale.py` times the coordinator's plan phase on a "
             "hit at 8,960 ranks (its structure comparison and every rank's flag gathered and answered, "
             "through the real consensus code, without the network's latency) against its first planning "
             "(unpack of the local plans and global plan)."),
            ("- Resharded loads on one machine: a piece read by both processes is read from the disk once, the "
             "second read hits the page cache, so reading whole pieces (DCP) costs less here than on a shared "
             "file system. Shard(0) -> Shard(1) needs a strided half of every row of every saved piece: each "
             "process verifies every saved byte (its wanted half-rows lie inside every checksum chunk) and "
             "copies its half out, from a read-only mapping of the files, so two processes do about twice "
             "the floor's CPU work on two cores. Shard(1) -> Shard(0) needs a contiguous run of each saved "
             "piece that is strided in the destination (verified and copied out of the mapping, trimmed to "
             "the 1 MiB chunks it touches); 2 -> 1 reads each saved piece straight into its part of the "
             "destination."),
            ("- `bcp, read_once=True` (DP-replicated load): each byte is read from storage by one process and "
             "sent to the other over gloo (TCP on loopback here). It halves what storage serves, which pays on "
             "shared storage across nodes; on one machine the second process's read would hit the page cache "
             "anyway, so the transfer is extra work here."),
            ("- Floors and memcpy are medians of the same interleaved rounds; on a busy machine their spread "
             "(shown per row) is as wide as the methods'."), ""]
