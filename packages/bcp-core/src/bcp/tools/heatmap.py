"""The heat map of one operation: every rank's time in a phase, laid out by its topology coordinates
(pipeline stages down, data-parallel ranks across, one panel per tensor-parallel rank; other
coordinates join the columns), on a colour scale from zero, the straggler (if any) outlined; below
it, the operations of the log over time. Ranks without coordinates (or whose coordinates collide)
are laid out by rank number."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from bcp.api.metrics import OpRecord, RankRecord
from bcp.tools.op_summary import Report, phase_seconds
from bcp.tools.units import human_bytes

# Which coordinate goes where, by preference; coordinates not named here join the columns.
_PANELS, _ROWS, _COLUMNS = ("tp",), ("pp",), ("dp", "ep", "cp")
_NAMES = {"pp": "pipeline stage (pp)", "dp": "data-parallel rank (dp)", "tp": "tensor-parallel rank (tp)",
          "ep": "expert-parallel rank (ep)", "cp": "context-parallel rank (cp)"}


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each rank is drawn: ``cells[rank] = (panel, row, column)``, with the axes' labels."""

    cells: dict[int, tuple[int, int, int]]
    panel_labels: list[str]
    row_labels: list[str]
    column_labels: list[str]
    row_title: str
    column_title: str


@dataclass(frozen=True, slots=True)
class Heatmap:
    """The PNG written, and the pixel (x, y from the top left) at the centre of each rank's cell in
    the map of time (``centres``) and in the map of bytes below it (``byte_centres``)."""

    path: str
    size: tuple[int, int]
    centres: dict[int, tuple[float, float]]
    cell_size: tuple[float, float]
    byte_centres: dict[int, tuple[float, float]] = field(default_factory=dict)


def layout_of(topologies: dict[int, dict[str, int]]) -> Layout:
    """Panels, rows and columns from the coordinates every rank has; by rank number otherwise."""
    shared = set.intersection(*(set(t) for t in topologies.values())) if topologies else set()
    panel_keys = [k for k in _PANELS if k in shared]
    row_keys = [k for k in _ROWS if k in shared]
    column_keys = [k for k in _COLUMNS if k in shared] + sorted(shared - set(_PANELS + _ROWS + _COLUMNS))
    if not row_keys and len(column_keys) > 1:
        row_keys = [column_keys.pop()]
    if shared:
        layout = _by_keys(topologies, panel_keys, row_keys, column_keys)
        if len(set(layout.cells.values())) == len(topologies):
            return layout
    return _by_rank(sorted(topologies))


def _by_keys(topologies: dict[int, dict[str, int]], panel_keys: list[str], row_keys: list[str],
             column_keys: list[str]) -> Layout:
    def axis(keys: list[str]) -> tuple[dict[tuple[int, ...], int], list[str]]:
        values = sorted({tuple(t[k] for k in keys) for t in topologies.values()})
        labels = [",".join(f"{k}={v}" for k, v in zip(keys, value)) if len(keys) > 1 else str(value[0]) if keys
                  else "" for value in values]
        return {value: i for i, value in enumerate(values)}, labels

    (panels, panel_labels), (rows, row_labels), (columns, column_labels) = (
        axis(panel_keys), axis(row_keys), axis(column_keys))
    cells = {rank: (panels[tuple(t[k] for k in panel_keys)], rows[tuple(t[k] for k in row_keys)],
                    columns[tuple(t[k] for k in column_keys)]) for rank, t in topologies.items()}
    panel_labels = [f"{panel_keys[0]} = {label}" if len(panel_keys) == 1 else label for label in panel_labels]
    return Layout(cells, panel_labels, row_labels, column_labels, " / ".join(_NAMES.get(k, k) for k in row_keys),
                  " / ".join(_NAMES.get(k, k) for k in column_keys))


def _by_rank(ranks: list[int]) -> Layout:
    """Ranks in reading order on a near-square grid; each row is labelled with the ranks it holds
    (every cell names its rank), the columns have no labels of their own."""
    columns = max(1, math.ceil(math.sqrt(len(ranks))))
    rows = [ranks[start:start + columns] for start in range(0, len(ranks), columns)] or [[]]
    cells = {rank: (0, i // columns, i % columns) for i, rank in enumerate(ranks)}
    row_labels = [f"{row[0]}" if len(row) == 1 else f"{row[0]}\u2013{row[-1]}" for row in rows if row] or [""]
    return Layout(cells, [""], row_labels, [""] * columns, "ranks", "")


def draw_heatmap(summary: Report, path: "str | os.PathLike", dpi: int = 100,
                 history: Sequence[OpRecord] = ()) -> Heatmap:
    """Draw ``summary``'s phase (time per rank) as a heat map PNG at ``path``, the bytes each rank
    wrote or read below it (tensors and values apart); with ``history`` (the log's records, the
    summarized one among them) a timeline of those operations at the bottom."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record, phase = summary.record, summary.phase
    history = history if len(history) > 1 else ()  # one operation has no course over time
    seconds = phase_seconds(record, phase)
    scale, unit = _time_unit(max(seconds.values(), default=0.0))
    layout = layout_of({r.rank: r.topology for r in record.ranks if r.rank in seconds})
    n_panels, n_rows, n_columns = len(layout.panel_labels), len(layout.row_labels), len(layout.column_labels)
    straggler = summary.straggler.slowest_rank if summary.straggler and summary.straggler.phase == phase else None
    by_rank = {r.rank: r for r in record.ranks}

    width = min(4.5 + 1.1 * n_columns * n_panels, 40.0)
    map_height = min(2.4 + 0.75 * n_rows, 30.0)
    timeline_height = 2.2 if history else 0.0
    fig = plt.figure(figsize=(max(width, 7.0 if history else 0.0), 2 * map_height + timeline_height), dpi=dpi,
                     layout="constrained")
    heights = [map_height, map_height] + ([timeline_height] if history else [])
    grid = fig.add_gridspec(len(heights), n_panels, height_ratios=heights)
    time_axes = [fig.add_subplot(grid[0, p]) for p in range(n_panels)]
    byte_axes = [fig.add_subplot(grid[1, p]) for p in range(n_panels)]
    times = {rank: seconds[rank] * scale for rank in seconds}
    _draw_map(fig, time_axes, layout, times, lambda rank: f"{times[rank]:.3g} {unit}", straggler,
              f"{phase} time per rank ({unit})")
    moved = {rank: float(by_rank[rank].bytes) for rank in seconds}
    bytes_scale, bytes_unit = _bytes_unit(max(moved.values(), default=0.0))
    verb = "written" if record.op == "save" else "read"
    _draw_map(fig, byte_axes, layout, {rank: n / bytes_scale for rank, n in moved.items()},
              lambda rank: _bytes_text(by_rank[rank]), straggler, f"bytes {verb} per rank ({bytes_unit})")
    if straggler is not None:
        outline = plt.Rectangle((0, 0), 1, 1, fill=False, edgecolor="red", linewidth=3)
        fig.legend(handles=[outline], labels=["straggler"], loc="outside lower left", fontsize=8, frameon=False)
    fig.suptitle(f"{record.title}: {phase} time and bytes {verb} per rank\n{_verdict(summary, scale, unit)}",
                 fontsize=10)
    if history:
        _draw_timeline(fig.add_subplot(grid[2, :]), history, record)
    fig.canvas.draw()
    size = fig.canvas.get_width_height()
    centres, cell = _centres(time_axes, layout, size)
    byte_centres, _ = _centres(byte_axes, layout, size)
    fig.savefig(os.fspath(path), dpi=dpi)
    plt.close(fig)
    return Heatmap(os.fspath(path), size, centres, cell, byte_centres)


def _draw_map(fig: Any, axes: list[Any], layout: Layout, values: dict[int, float], text: Any,
              straggler: int | None, label: str) -> None:
    """One map over the layout: each rank's value as a colour on a scale from zero (a few percent of
    spread stays a few shades), ``text(rank)`` in its cell, the straggler outlined."""
    import matplotlib.pyplot as plt
    import numpy as np

    grids = np.full((len(layout.panel_labels), len(layout.row_labels), len(layout.column_labels)), np.nan)
    for rank, (p, r, c) in layout.cells.items():
        grids[p, r, c] = values[rank]
    high = max(values.values(), default=0.0) or 1.0
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")  # grey: no rank at these coordinates
    image = None
    for p, ax in enumerate(axes):
        image = ax.imshow(grids[p], cmap=cmap, vmin=0.0, vmax=high, aspect="auto")
        ax.set_yticks(range(len(layout.row_labels)), layout.row_labels)
        ax.set_ylabel(layout.row_title)
        if layout.column_title:
            ax.set_xticks(range(len(layout.column_labels)), layout.column_labels)
            ax.set_xlabel(layout.column_title)
        else:
            ax.set_xticks([])
        if layout.panel_labels[p]:
            ax.set_title(layout.panel_labels[p])
        for rank, (panel, r, c) in layout.cells.items():
            if panel != p:
                continue
            ax.text(c, r, f"rank {rank}\n{text(rank)}", ha="center", va="center", fontsize=8,
                    color="white" if values[rank] < 0.6 * high else "black")
            if rank == straggler:
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=3))
    fig.colorbar(image, ax=axes, label=label)


def _centres(axes: list[Any], layout: Layout, size: tuple[int, int]) -> tuple[dict[int, tuple[float, float]],
                                                                              tuple[float, float]]:
    """Each rank's cell centre in pixels from the top left, and a cell's size."""
    centres: dict[int, tuple[float, float]] = {}
    cell = (0.0, 0.0)
    for rank, (p, r, c) in layout.cells.items():
        transform = axes[p].transData
        x, y = transform.transform((c, r))
        x1, y1 = transform.transform((c + 1, r + 1))
        centres[rank] = (float(x), float(size[1] - y))
        cell = (abs(float(x1 - x)), abs(float(y1 - y)))
    return centres, cell


def _bytes_text(rank: RankRecord) -> str:
    """A cell's bytes: tensors and values apart where the record tells them apart."""
    if rank.value_bytes is None:
        return human_bytes(rank.bytes)
    return f"T {human_bytes(rank.tensor_bytes or 0)}\nV {human_bytes(rank.value_bytes)}"


def _bytes_unit(most: float) -> tuple[float, str]:
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if most >= 1024 ** power:
            return float(1024 ** power), unit
    return 1.0, "B"


def _verdict(summary: Report, scale: float, unit: str) -> str:
    """The straggler, or how far the slowest rank is from the median when none is flagged."""
    flagged = summary.straggler
    widest = flagged or summary.widest
    if widest is None:
        return "one rank: no straggler"
    gap = f"{widest.gap * scale:.3g} {unit} ({widest.ratio:.2f}x) above the median"
    if flagged is not None:
        return f"straggler: rank {flagged.slowest_rank} in {flagged.phase}, {gap}"
    return f"no straggler: the slowest, rank {widest.slowest_rank} in {widest.phase}, is {gap}"


def _time_unit(longest: float) -> tuple[float, str]:
    """Milliseconds below a second, else seconds: the scale and the unit's name."""
    return (1e3, "ms") if longest < 1.0 else (1.0, "s")


_MARKERS = {"save": ("o", "tab:blue"), "load": ("s", "tab:orange")}


def _draw_timeline(ax: Any, history: Sequence[OpRecord], shown: OpRecord) -> None:
    """Each operation of the log as a stem at its start, as high as it took; failures as red crosses,
    the operation of the heat map ringed."""
    origin = min(r.start for r in history)
    span = max(r.start for r in history) - origin
    scale, unit = (1 / 3600, "hours") if span > 3 * 3600 else (1 / 60, "minutes") if span > 180 else (1.0, "seconds")
    longest = max((r.seconds for r in history), default=0.0)
    y_scale, y_unit = _time_unit(longest)
    for op, (marker, colour) in _MARKERS.items():
        done = [r for r in history if r.op == op and r.ok]
        if done:
            xs = [(r.start - origin) * scale for r in done]
            ys = [r.seconds * y_scale for r in done]
            ax.vlines(xs, 0, ys, colors=colour, linewidth=1)
            ax.scatter(xs, ys, marker=marker, color=colour, label=op, zorder=3)
    failed = [r for r in history if not r.ok]
    if failed:
        ax.scatter([(r.start - origin) * scale for r in failed], [r.seconds * y_scale for r in failed],
                   marker="x", color="red", label="failed", zorder=3)
    ax.scatter([(shown.start - origin) * scale], [shown.seconds * y_scale], s=220, facecolors="none",
               edgecolors="black", linewidths=1.5, label="shown above", zorder=4)
    ax.set_ylim(0, max(longest * y_scale * 1.35, 1e-9))
    ax.set_xlabel(f"start ({unit} since the log's first operation)")
    ax.set_ylabel(f"duration ({y_unit})")
    ax.set_title(f"operations in the log ({len(history)})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", ncols=4, fontsize=8, frameon=False)
