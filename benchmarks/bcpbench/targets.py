"""bcp's performance targets, checked against one run's medians. Every figure is a ratio to something
measured in the same run (the disk's floors, a bare copy, DCP), so a slow or busy machine moves
both sides alike; a target missed is reported as missed with its measured ratio."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bcpbench import cold_floor as floor
from bcpbench import compression as z
from bcpbench import distributed as d2
from bcpbench import every_step as every
from bcpbench import incremental as inc
from bcpbench import single as d1
from bcpbench import tensor_path as tp
from bcpbench.methods import FIRST_SAVE
from bcpbench.record import Record

BCP, DCP = "bcp", "DCP"
BARE_COPY, MEMCPY = "bare copy into reused buffers", "memcpy"


@dataclass
class Check:
    target: str
    where: str
    measured: float | None  # None: not measured in this run
    goal: float
    at_least: bool  # the measured ratio must be >= goal (else <= goal)
    unit: str = "x"

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.goal if self.at_least else self.measured <= self.goal


def floor_seconds(record: Record, case: str) -> float | None:
    """The fastest raw transfer of the case's bytes (1 or several threads): the disk's floor."""
    raws = [record.median(case, m) for m in record.samples.get(case, {}) if m.startswith("raw ")]
    raws = [r for r in raws if r is not None]
    return min(raws) if raws else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def per_tensor_ms(record: Record, case: str, method: str) -> float | None:
    """(time for N small tensors - time for the same bytes as one tensor) / N, in ms."""
    many, one = record.median(f"{case}, many", method), record.median(f"{case}, one", method)
    count = record.figures.get("per-tensor workload", {}).get("tensors")
    return (many - one) / count * 1e3 if many is not None and one is not None and count else None


def per_byte(record: Record, case: str, method: str, reference: str = tp.MODULE) -> float | None:
    """Seconds per byte of ``method`` in ``case`` over those of ``reference`` (a time ratio)."""
    sizes = record.figures.get(tp.BYTES + case, {})
    seconds, reference_seconds = record.median(case, method), record.median(case, reference)
    if seconds is None or reference_seconds is None or method not in sizes or reference not in sizes:
        return None
    return ratio(seconds / sizes[method], reference_seconds / sizes[reference])


def written_share(record: Record, method: str) -> float | None:
    """Data bytes ``method`` wrote on all ranks of the 2-process save over the bytes of the state
    one process holds: 1.0 when each byte is written once."""
    written = record.figures.get(tp.WRITTEN, {}).get(method)
    state = record.figures.get(tp.BYTES + tp.SAVE_2P, {}).get(method)
    return ratio(sum(written.values()), state) if written and state else None


def plan_share(record: Record, label: str) -> float | None:
    """Median plan seconds of steady-state saves over those of first saves of the structure."""
    cached = [p["plan"] for p in record.figures.get(f"bcp save phases, {label}", [])]
    first = [p["plan"] for p in record.figures.get(f"bcp save phases, {label} first", [])]
    return ratio(statistics.median(cached), statistics.median(first)) if cached and first else None


def checks(record: Record, scale: dict | None = None) -> list[Check]:
    """The targets of one run; ``scale`` holds ``planning_scale.py``'s figures, if it ran."""
    out: list[Check] = []
    for case in (d1.SAVE, d2.SAVE_SHARDED, d2.SAVE_COLUMNS, d2.SAVE_REPLICATED):
        out.append(Check("sync save vs raw fsync'd write", case,
                         ratio(floor_seconds(record, case), record.median(case, BCP)), 0.9, True))
    for case in (d1.COLD, d2.COLD_SAME, d2.RESHARDED, d2.TO_ONE, d2.ROWS_FROM_COLUMNS):
        out.append(Check("cold load vs raw cold read", case,
                         ratio(floor_seconds(record, case), record.median(case, BCP)), 0.9, True))
    for case in floor.CASES:
        out.append(Check("cold load with the defaults vs raw cold read into the live tensors", case,
                         floor.paired_ratio(record, case), 0.9, True))
    for case in (d1.WARM, d2.WARM_SAME):
        out.append(Check("warm load vs memcpy of the state", case,
                         ratio(record.median(case, MEMCPY), record.median(case, BCP)), 0.8, True))
    out.append(Check("async blocking vs bare copy into reused buffers", d1.ASYNC_BLOCK,
                     ratio(record.median(d1.ASYNC_BLOCK, "bcp async_save"), record.median(d1.ASYNC_BLOCK, BARE_COPY)),
                     1.5, False))
    for label, where in (("2p", d2.SAVE_SHARDED), ("1p", d1.SAVE), ("per-tensor many", "per-tensor: save, many")):
        share = plan_share(record, label)
        out.append(Check("cached re-planning vs first planning", where,
                         None if share is None else share * 100, 2.0, False, "%"))
    if scale and "cached_replan_share_pct" in scale:
        out.append(Check("cached re-planning vs first planning",
                         f"coordinator of {scale['ranks']} ranks (planning_scale.py, simulated)",
                         scale["cached_replan_share_pct"], 2.0, False, "%"))
    for case, method, what in (("per-tensor: save", BCP, "save, cached plan"),
                               ("per-tensor: save", FIRST_SAVE, "save, first of the structure"),
                               ("per-tensor: load warm", BCP, "warm load")):
        out.append(Check("per-tensor overhead", what, per_tensor_ms(record, case, method), 0.05, False, " ms"))
    for case in (d1.SAVE, d2.SAVE_SHARDED, d2.SAVE_COLUMNS, d2.SAVE_REPLICATED):
        out.append(Check("save speed vs DCP", case, ratio(record.median(case, DCP), record.median(case, BCP)),
                         1.5, True))
    for case in (d1.COLD, d2.COLD_SAME):
        out.append(Check("cold load speed vs DCP", case, ratio(record.median(case, DCP), record.median(case, BCP)),
                         1.5, True))
    for case in (d2.RESHARDED, d2.TO_ONE, d2.ROWS_FROM_COLUMNS):
        out.append(Check("resharded load speed vs DCP", case,
                         ratio(record.median(case, DCP), record.median(case, BCP)), 2.0, True))
    share = ratio(record.median(d1.ASYNC_BLOCK, "bcp async_save"), record.median(d1.SAVE, DCP))
    out.append(Check("async blocking vs a DCP sync save", d1.ASYNC_BLOCK + " / " + d1.SAVE,
                     None if share is None else share * 100, 10.0, False, "%"))
    for case, method in ((tp.SAVE_1P, tp.DICT), (tp.SAVE_1P, tp.TOP), (tp.COLD_1P, tp.DICT), (tp.COLD_1P, tp.TOP),
                         (tp.SAVE_2P, tp.EMA), (tp.COLD_2P, tp.EMA)):
        out.append(Check(f"seconds per byte vs {tp.MODULE}", f"{case}: {method}", per_byte(record, case, method),
                         1.1, False))
    out.append(Check("data bytes written vs the state's (each byte once)", f"{tp.SAVE_2P}: {tp.EMA}",
                     written_share(record, tp.EMA), 1.01, False))
    out.append(Check("step time, bcp save at every step vs no checkpoint", every.STEP + ": " + every.OVERLAP,
                     every.step_ratio(record, every.OVERLAP), 1.03, False))
    return out + incremental_checks(record) + compression_checks(record)


def incremental_checks(record: Record) -> list[Check]:
    """Incremental saves against the trainable part saved alone (time and bytes, the ratio of the
    two: lower is better), and the load of their last generation against a whole checkpoint's."""
    return [Check("incremental save time / the trainable part alone's", inc.LATER,
                  ratio(record.median(inc.LATER, inc.INCREMENTAL), record.median(inc.LATER, inc.TRAINABLE)), 1.2,
                  False),
            Check("incremental bytes written / the trainable part alone's", inc.LATER,
                  ratio(inc.written_bytes(record, inc.INCREMENTAL), inc.written_bytes(record, inc.TRAINABLE)), 1.2,
                  False),
            Check("load of save 5, incremental vs whole", inc.LOAD,
                  ratio(record.median(inc.LOAD, inc.WHOLE), record.median(inc.LOAD, inc.INCREMENTAL)), 0.9, True)]


def compression_checks(record: Record) -> list[Check]:
    """bcp's compressed checkpoints of trained states: their size against the raw bytes, and on S3
    their save and load time against uncompressed ones (no slower)."""
    out = [Check("compressed size: raw bytes / stored bytes", f"{label}: {z.BCP_COMPRESSED}",
                 z.compressed_ratio(record, label), goal, True)
           for label, goal in ((z.BF16, 1.4), (z.MIXED, 1.25))]
    for label in (z.BF16, z.MIXED):
        for what in ("save", "cold load"):
            for where in (z.S3, z.PACED):
                out.append(Check(f"S3 {what} time, bcp uncompressed / compressed", z.case(label, what, where),
                                 z.time_ratio(record, label, what, where), 1.0, True))
    return out
