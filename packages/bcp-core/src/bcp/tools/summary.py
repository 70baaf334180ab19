"""``bcp inspect``: what a checkpoint holds, from its manifest alone (no data is read)."""

from __future__ import annotations

import datetime
import math
from fnmatch import fnmatchcase
from typing import Any, Sequence

from bcp.layout.dtypes import dtype_from_name, itemsize
from bcp.layout.manifest import Manifest, TensorEntry
from bcp.tools.checkpoint import Checkpoint
from bcp.tools.units import human_bytes


def summarize(checkpoint: Checkpoint, *, filters: Sequence[str] = ()) -> dict[str, Any]:
    """A plain-data description: generation and commit state, format, sizes, components, and one
    row per tensor and per value (only those matching a ``filters`` glob, when given)."""
    manifest = checkpoint.manifest

    def wanted(name: str) -> bool:
        return not filters or any(fnmatchcase(name, glob) for glob in filters)

    components: dict[str, dict[str, int]] = {}
    for name in manifest.tensors:
        components.setdefault(name.split("/", 1)[0], {"tensors": 0, "values": 0})["tensors"] += 1
    for name in manifest.objects:
        components.setdefault(name.split("/", 1)[0], {"tensors": 0, "values": 0})["values"] += 1
    # Tensors that share stored bytes (tied weights) count them once.
    stored = {(s.bytes.file, s.bytes.offset, s.bytes.nbytes, s.bytes.stored_nbytes)
              for e in manifest.tensors.values() for s in e.shards}
    raw_bytes, stored_bytes = sum(r[2] for r in stored), sum(r[3] for r in stored)
    return {
        "path": checkpoint.path,
        "generation": checkpoint.generation,
        "generations": [{"generation": g, "committed": c, **_kept(checkpoint, g, c)}
                        for g, c in checkpoint.generations()],
        "format_version": manifest.version,
        "writer": manifest.writer,
        "created": _timestamp(manifest.created_unix),
        "step": manifest.step,
        "framework": manifest.framework,
        "world_size": manifest.world_size,
        "unsafe_pickle": manifest.unsafe_pickle,
        "files": len(manifest.files),
        "tensor_bytes": raw_bytes,
        "stored_tensor_bytes": stored_bytes,
        "ratio": _ratio(raw_bytes, stored_bytes),
        "compression": None if manifest.compression is None else manifest.compression.to_manifest(),
        "value_bytes": sum(r.nbytes for e in manifest.objects.values() for r, _ in e.records),
        "components": components,
        "tensors": [_tensor_row(e) for name, e in manifest.tensors.items() if wanted(name)],
        "values": [
            {"name": name, "records": len(e.records), "saved_by_ranks": sum(1 for r in e.ranks if r >= 0),
             "nbytes": sum(r.nbytes for r, _ in e.records)}
            for name, e in manifest.objects.items() if wanted(name)
        ],
    }


def _kept(checkpoint: Checkpoint, generation: int, committed: bool) -> dict[str, Any]:
    """When a kept generation was committed and the training step it was saved at (None where the
    save did not say), from its manifest (a loadable one: ``bcp.load(..., generation=N)``)."""
    if not committed:
        return {"created": None, "step": None}
    if generation == checkpoint.generation:
        manifest = checkpoint.manifest
    else:
        data, table = checkpoint.location.read_manifest_files(generation)
        manifest = Manifest.decode(data, table, path=checkpoint.path)
    return {"created": _timestamp(manifest.created_unix), "step": manifest.step}


def layout_of(entry: TensorEntry) -> str:
    """How the tensor was cut when saved: ``whole``, a grid (``dim 0 / 2``), or irregular boxes."""
    boxes = [s.box for s in entry.shards]
    if not boxes:
        return "empty"
    if len(boxes) == 1 and boxes[0].lengths == entry.shape:
        return "whole"
    cuts = [sorted({(b.offsets[d], b.lengths[d]) for b in boxes}) for d in range(len(entry.shape))]
    is_grid = math.prod(len(c) for c in cuts) == len(boxes) and all(
        _tiles(c, size) for c, size in zip(cuts, entry.shape))
    if not is_grid:
        return f"{len(boxes)} irregular boxes"
    return " x ".join(f"dim {d} / {len(c)}" for d, c in enumerate(cuts) if len(c) > 1)


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as text for a terminal."""
    states = "; ".join(f"{g['generation']} {_state(g)}" for g in summary["generations"])
    lines = [
        f"checkpoint   {summary['path']}",
        f"generation   {summary['generation']}"
        + ("" if summary["step"] is None else f", step {summary['step']}") + f" (all generations: {states})",
        f"format       bcp v{summary['format_version']}, written by {summary['writer'] or '?'} "
        f"at {summary['created']}",
        f"saved from   {summary['framework']}, world size {summary['world_size']}",
        f"data         {human_bytes(summary['tensor_bytes'])} of tensors{_stored_as(summary)}, "
        f"{human_bytes(summary['value_bytes'])} of values, in {summary['files']} file(s)",
        "components   " + ", ".join(f"{name} ({_count(c['tensors'], 'tensor')}, {_count(c['values'], 'value')})"
                                   for name, c in summary["components"].items()),
    ]
    if summary["unsafe_pickle"]:
        lines.append("warning      holds pickled values: loading them needs allow_pickle=True and can run code")
    if summary["tensors"]:
        compressed = _compressed(summary)
        lines += ["", *_table(
            ["TENSOR", "DTYPE", "SHAPE", "SIZE", *(["STORED", "RATIO"] if compressed else []), "SHARDS", "LAYOUT"],
            [[t["name"], t["dtype"], str(t["shape"]), human_bytes(t["nbytes"]),
              *([human_bytes(t["stored_nbytes"]), f"{t['ratio']:.2f}x"] if compressed else []),
              str(t["shards"]), t["layout"]] for t in summary["tensors"]])]
    if summary["values"]:
        lines += ["", *_table(["VALUE", "RECORDS", "SAVED BY", "SIZE"], [
            [v["name"], str(v["records"]), f"{v['saved_by_ranks']} rank(s)", human_bytes(v["nbytes"])]
            for v in summary["values"]])]
    return "\n".join(lines)


def _state(generation: dict[str, Any]) -> str:
    if not generation["committed"]:
        return "NOT committed"
    step = "" if generation["step"] is None else f", step {generation['step']}"
    return f"committed at {generation['created']}{step}"


def _tensor_row(entry: TensorEntry) -> dict[str, Any]:
    numel = math.prod(entry.shape)
    nbytes = numel * itemsize(dtype_from_name(entry.dtype))
    stored = sum(s.bytes.stored_nbytes for s in entry.shards)
    return {"name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape), "numel": numel,
            "nbytes": nbytes, "stored_nbytes": stored, "ratio": _ratio(nbytes, stored), "shards": len(entry.shards),
            "layout": layout_of(entry)}


def _ratio(raw: int, stored: int) -> float:
    """Raw bytes per stored byte (1.0 for nothing stored), to 3 decimals."""
    return round(raw / stored, 3) if stored else 1.0


def _compressed(summary: dict[str, Any]) -> bool:
    return summary["compression"] is not None or summary["stored_tensor_bytes"] != summary["tensor_bytes"]


def _stored_as(summary: dict[str, Any]) -> str:
    """How the tensors' bytes are stored, where compressed: `` (0.8 GiB stored in zstd, 1.50x)``."""
    if not _compressed(summary):
        return ""
    codec = (summary["compression"] or {}).get("codec")
    return (f" ({human_bytes(summary['stored_tensor_bytes'])} stored" + (f" in {codec}" if codec else "")
            + f", {summary['ratio']:.2f}x)")


def _tiles(intervals: list[tuple[int, int]], size: int) -> bool:
    end = 0
    for offset, length in intervals:
        if offset != end:
            return False
        end += length
    return end == size


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _timestamp(unix: float) -> str:
    if not unix:
        return "?"
    return datetime.datetime.fromtimestamp(unix, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
