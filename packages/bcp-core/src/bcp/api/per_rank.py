"""Per-rank values across a change of world size: the rules, and the report when one applies.

Saved on N ranks and loaded on M:

- rank r < N loads the value rank r saved;
- with M > N, rank r >= N loads rank 0's value (the first saving rank's where rank 0 saved none):
  the value is *duplicated*;
- with M < N, the values of saved ranks M..N-1 are loaded by no rank: they are *dropped*.

A duplicated or dropped value is reported (``LoadResult.duplicated``/``dropped`` and one WARNING on
the coordinating rank naming the values and the ranks), except where the saved ranks held identical
values (one shared record, so the rule changes nothing) or, for a drop, where a loading rank holds the
dropped rank's value.
"""

from __future__ import annotations

import logging
from typing import Iterable

from bcp.layout.manifest import ObjectEntry

logger = logging.getLogger("bcp")


def world_change(objects: dict[str, ObjectEntry], names: Iterable[str],
                 world_size: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """``(duplicated, dropped)``: per value name, the loading ranks that receive another rank's
    value, and the saved ranks whose value no loading rank receives."""
    duplicated: dict[str, list[int]] = {}
    dropped: dict[str, list[int]] = {}
    for name in names:
        records = objects[name].ranks
        saved = [r for r, record in enumerate(records) if record >= 0]
        if len(saved) > 1 and len({records[r] for r in saved}) == 1:
            continue
        receivers = [r for r in range(world_size) if r >= len(records) or records[r] < 0]
        if receivers and saved:
            duplicated[name] = receivers
        kept = {records[r] for r in saved if r < world_size}
        lost = [r for r in saved if r >= world_size and records[r] not in kept]
        if lost:
            dropped[name] = lost
    return duplicated, dropped


def warn_world_change(path: str, saved_world: int, world_size: int, duplicated: dict[str, list[int]],
                      dropped: dict[str, list[int]]) -> None:
    if duplicated:
        logger.warning("bcp load %s: saved on %d rank(s), loaded on %d: rank(s) without a value of their own "
                       "received rank 0's: %s", path, saved_world, world_size, _listed(duplicated))
    if dropped:
        logger.warning("bcp load %s: saved on %d rank(s), loaded on %d: the values of saved rank(s) beyond "
                       "the world size were not loaded: %s", path, saved_world, world_size, _listed(dropped))


def _listed(by_name: dict[str, list[int]]) -> str:
    shown = [f"{name} (ranks {ranks})" for name, ranks in list(by_name.items())[:10]]
    more = f" and {len(by_name) - 10} more" if len(by_name) > 10 else ""
    return ", ".join(shown) + more
