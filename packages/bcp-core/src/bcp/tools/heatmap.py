"""The heat map of one operation: every rank's time in a phase, laid out by its topology coordinates
(pipeline stages down, data-parallel ranks across, one panel per tensor-parallel rank; other
coordinates join the columns), the straggler outlined. Ranks without coordinates (or whose
coordinates collide) are laid out by rank number."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from bcp.tools.report import Report, phase_seconds

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
    """The PNG written, and the pixel (x, y from the top left) at the centre of each rank's cell."""

    path: str
    size: tuple[int, int]
    centres: dict[int, tuple[float, float]]
    cell_size: tuple[float, float]


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
    columns = max(1, math.ceil(math.sqrt(len(ranks))))
    rows = max(1, math.ceil(len(ranks) / columns))
    cells = {rank: (0, i // columns, i % columns) for i, rank in enumerate(ranks)}
    return Layout(cells, [""], [str(r * columns) for r in range(rows)], [f"+{c}" for c in range(columns)],
                  "rank (row start)", "rank (offset)")


def draw_heatmap(summary: Report, path: "str | os.PathLike", dpi: int = 100) -> Heatmap:
    """Draw ``summary``'s phase (seconds per rank) as a heat map PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    record, phase = summary.record, summary.phase
    seconds = phase_seconds(record, phase)
    layout = layout_of({r.rank: r.topology for r in record.ranks if r.rank in seconds})
    n_panels, n_rows, n_columns = len(layout.panel_labels), len(layout.row_labels), len(layout.column_labels)
    grids = np.full((n_panels, n_rows, n_columns), np.nan)
    for rank, (p, r, c) in layout.cells.items():
        grids[p, r, c] = seconds[rank]
    finite = [v for v in seconds.values()]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    straggler = max(seconds, key=seconds.__getitem__) if seconds else None
    median = float(np.median(finite)) if finite else 0.0

    width = min(4.0 + 1.1 * n_columns * n_panels, 40.0)
    height = min(2.6 + 0.75 * n_rows, 30.0)
    fig, axes = plt.subplots(1, n_panels, figsize=(width, height), dpi=dpi, squeeze=False, layout="constrained")
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")  # grey: no rank at these coordinates
    image = None
    for p, ax in enumerate(axes[0]):
        image = ax.imshow(grids[p], cmap=cmap, vmin=low, vmax=high if high > low else low + 1e-9, aspect="auto")
        ax.set_xticks(range(n_columns), layout.column_labels)
        ax.set_yticks(range(n_rows), layout.row_labels)
        ax.set_xlabel(layout.column_title or "column")
        ax.set_ylabel(layout.row_title or "row")
        if layout.panel_labels[p]:
            ax.set_title(layout.panel_labels[p])
        for rank, (panel, r, c) in layout.cells.items():
            if panel != p:
                continue
            value = seconds[rank]
            light = value < low + 0.6 * (high - low) if high > low else True
            ax.text(c, r, f"rank {rank}\n{value:.3g} s", ha="center", va="center", fontsize=8,
                    color="white" if light else "black")
            if rank == straggler:
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=3))
    fig.colorbar(image, ax=list(axes[0]), label=f"{phase} time (s)")
    outline = plt.Rectangle((0, 0), 1, 1, fill=False, edgecolor="red", linewidth=3)
    fig.legend(handles=[outline], labels=["straggler (slowest rank)"], loc="outside lower left", fontsize=8,
               frameon=False)
    ratio = seconds[straggler] / median if straggler is not None and median > 0 else 1.0
    fig.suptitle(f"bcp {record.op} generation {record.generation}: {phase} time per rank (s); straggler rank "
                 f"{straggler}, max/median {ratio:.2f}", fontsize=10)
    fig.canvas.draw()
    size = fig.canvas.get_width_height()
    centres: dict[int, tuple[float, float]] = {}
    cell = (0.0, 0.0)
    for rank, (p, r, c) in layout.cells.items():
        transform = axes[0][p].transData
        x, y = transform.transform((c, r))
        x1, y1 = transform.transform((c + 1, r + 1))
        centres[rank] = (float(x), float(size[1] - y))
        cell = (abs(float(x1 - x)), abs(float(y1 - y)))
    fig.savefig(os.fspath(path), dpi=dpi)
    plt.close(fig)
    return Heatmap(os.fspath(path), size, centres, cell)
