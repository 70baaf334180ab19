"""The compression cases' tables: per state, every codec alone next to whole checkpoints
on the local disk (ratio, save and load time, MB/s per core), each codec's ratio per part of the
mixed-precision state, and bcp uncompressed vs compressed on S3."""

from __future__ import annotations

import statistics

from bcpbench.compression import BCP, CODECS, CPU, LOCAL, PACED, S3, TRAINING, case, compressed_ratio
from bcpbench.record import Record
from bcpbench.targets import ratio
from bcpbench.trained import BF16, MIXED, PARTS

MB = 1e6


def report_lines(record: Record) -> list[str]:
    training = record.figures.get(TRAINING)
    if not training:
        return []
    lines = _training(record, training)
    for label in (BF16, MIXED):
        lines += _side_by_side(record, label)
    lines += _parts(record)
    lines += _s3(record)
    return lines


def _training(record: Record, t: dict) -> list[str]:
    sizes = ", ".join(f"{label} {record.nbytes.get(case(label, 'save', LOCAL), 0) / MB:.0f} MB"
                      for label in (BF16, MIXED))
    missing = "" if t["bcp_compresses"] else (" The bcp measured has no `compression` option: its compressed rows "
                                              "are missing.")
    return [(f"An MLP of {t['layers']} blocks (LayerNorm, Linear {t['width']} x {t['width']}, GELU) and an output "
             f"Linear, trained in the run for {t['steps']} AdamW steps (learning rate {t['lr']:g}, batch {t['batch']}, "
             f"{t['seconds']:.0f} s) "
             f"on a fixed synthetic data set: loss {t['first_loss']:.3g} -> {t['last_loss']:.3g}. Its weight "
             f"matrices moved by {t['relative_change']:.0%} of their initial norm, and their values' distribution "
             f"lies at a Kolmogorov-Smirnov distance of {t['ks_distance']:.3f} from the initial one (medians over "
             f"matrices). States: {sizes} (the mixed-precision checkpoint holds per parameter 2 bytes of bf16 "
             "weights, 4 of fp32 master weights and 4 + 4 of AdamW's two moments)."),
            "",
            ("Codecs alone: 1 MiB chunks (bcp's unit) on one thread, in memory, a chunk that does not shrink "
             "counted raw; save and load = compressing and decompressing everything. Checkpoints: saves fsync'd, "
             "loads cold (files evicted from the page cache first) into preallocated tensors, ratio = raw bytes "
             "over the bytes of all the checkpoint's files. `MB/s per core` = raw MB over the process's CPU "
             f"seconds; `vs bcp` = uncompressed bcp's median time over this one's.{missing}"), ""]


def _side_by_side(record: Record, label: str) -> list[str]:
    codec_figures = record.figures.get(CODECS, {}).get(label, {})
    save_case = case(label, "save", LOCAL)
    raw = record.nbytes.get(save_case)
    if not raw:
        return []
    lines = [f"### {label}, {raw / MB:.0f} MB", "",
             ("| method | ratio | save s | load s | save MB/s per core | load MB/s per core | save vs bcp "
              "| load vs bcp |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, f in codec_figures.items():
        lines.append(f"| codec alone: {name} | {_codec_ratio(f['raw'], f['stored'], f['differ'])} | "
                     f"{f['compress_cpu_s']:.3g} | {f['decompress_cpu_s']:.3g} | "
                     f"{_rate(f['raw'], f['compress_cpu_s'])} | {_rate(f['raw'], f['decompress_cpu_s'])} | - | - |")
    for method in record.samples.get(save_case, {}):
        lines.append(f"| {method} | {_x(compressed_ratio(record, label, method), 3)} | "
                     + _timings(record, label, LOCAL, method))
    return lines + [""]


def _parts(record: Record) -> list[str]:
    codec_figures = record.figures.get(CODECS, {}).get(MIXED, {})
    if not codec_figures:
        return []
    lines = [f"### Ratio per part, {MIXED}", "", "| codec | " + " | ".join(PARTS) + " | all |",
             "| --- |" + " --- |" * (len(PARTS) + 1)]
    for name, f in codec_figures.items():
        cells = [_codec_ratio(*f["by_part"][p]) if p in f["by_part"] else "-" for p in PARTS]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_codec_ratio(f['raw'], f['stored'], f['differ'])} |")
    return lines + [""]


def _codec_ratio(raw: int, stored: int, differ: int) -> str:
    """Raw over stored bytes, marked where chunks came back other than they went in."""
    return f"{raw / stored:.3f}x" + (f" (**not lossless: {differ} chunks differ**)" if differ else "")


def _s3(record: Record) -> list[str]:
    lines = []
    for label in (BF16, MIXED):
        for where, title in ((S3, "on S3 (SeaweedFS on 127.0.0.1)"), (PACED, f"on {PACED}")):
            save_case = case(label, "save", where)
            raw = record.nbytes.get(save_case)
            if not raw:
                continue
            lines += [f"### {label} {title}, {raw / MB:.0f} MB", "",
                      "| method | save s (min-max) | load s (min-max) | save MB/s per core | load MB/s per core | "
                      "save vs bcp | load vs bcp |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {method} | " + _timings(record, label, where, method, spread=True)
                      for method in record.samples[save_case]]
            lines.append("")
    if lines:
        lines += [("The server runs on the same machine: its CPU time is not in `MB/s per core` (this "
                   "process's only), and it competes for the cores with the client's compression. The emulated "
                   "link is a TCP proxy in a process of its own that paces the bytes each way (no latency, no loss); "
                   "uncompressed and compressed rounds alternate."), ""]
    return lines


def _timings(record: Record, label: str, where: str, method: str, spread: bool = False) -> str:
    """A checkpoint row's cells from the save's: median save and load seconds (with the fastest and
    slowest rounds where ``spread``), MB/s per core of each, and uncompressed bcp's median times
    over these."""
    save_case, load_case = case(label, "save", where), case(label, "cold load", where)
    raw = record.nbytes[save_case]
    save, load = record.median(save_case, method), record.median(load_case, method)
    return (f"{_seconds(record, save_case, method, spread)} | {_seconds(record, load_case, method, spread)} | "
            f"{_rate(raw, _cpu(record, save_case, method))} | "
            f"{_rate(raw, _cpu(record, load_case, method))} | {_x(ratio(record.median(save_case, BCP), save))} | "
            f"{_x(ratio(record.median(load_case, BCP), load))} |")


def _seconds(record: Record, which: str, method: str, spread: bool) -> str:
    values = record.samples[which][method]
    return f"{statistics.median(values):.3g}" + (f" ({min(values):.3g}-{max(values):.3g})" if spread else "")


def _cpu(record: Record, where: str, method: str) -> float | None:
    values = record.figures.get(CPU, {}).get(where, {}).get(method)
    return statistics.median(values) if values else None


def _rate(nbytes: int, seconds: float | None) -> str:
    return f"{nbytes / seconds / MB:.0f}" if seconds else "-"


def _x(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"
