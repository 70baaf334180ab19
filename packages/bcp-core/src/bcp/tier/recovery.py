"""Recovery: which generation of the memory tier can be loaded by the live ranks, and why not.

Every rank reports what its node folder holds (``local.census``); a generation can be loaded when
it is committed in at least one live folder and every data file its manifest names is held by some
rank whose folder committed it (a replaced node's ranks fetch their bytes from those holders, a
smaller job reads the survivors' folders). The newest such generation is chosen; where there is
none, the choice says which files, and so which ranks' shards, no live node holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from bcp.engine.location import writer_of_data_file
from bcp.tier.local import Held


@dataclass(slots=True)
class Choice:
    """The generation to load (None: none can be) and where each of its files lies."""

    generation: int | None
    #: Data file -> the ranks whose node folder holds it (committed).
    holders: dict[str, list[int]] = field(default_factory=dict)
    #: Data file -> its size.
    sizes: dict[str, int] = field(default_factory=dict)
    #: The ranks whose node folder committed the generation.
    holding: list[int] = field(default_factory=list)
    #: Why: the chosen generation and how it is complete, or what is missing.
    reason: str = ""


def choose(every_rank: list[list[Held]], nodes: tuple[str, ...]) -> Choice:
    """The newest generation complete across the live ranks' folders (``every_rank``: each rank's
    census, the same on every rank), or why there is none."""
    held = {rank: {h.generation: h for h in census} for rank, census in enumerate(every_rank)}
    committed = sorted({g for by_gen in held.values() for g, h in by_gen.items() if h.committed}, reverse=True)
    if not committed:
        return Choice(None, reason="no live node holds a committed generation of the memory tier")
    gaps = []
    for generation in committed:
        holding = [rank for rank in held if generation in held[rank] and held[rank][generation].committed]
        needed = held[holding[0]][generation].needed
        holders = {name: [r for r in holding if name in held[r][generation].present] for name in needed}
        missing = [name for name, ranks in holders.items() if not ranks]
        if not missing:
            local = sorted({nodes[r] for r in holding})
            return Choice(generation, holders,
                          {name: held[ranks[0]][generation].present[name] for name, ranks in holders.items()},
                          holding, f"generation {generation} is complete on the live node(s) {', '.join(local)}")
        gaps.append(f"generation {generation} lacks {_describe(missing)} on every live node")
    return Choice(None, reason="; ".join(gaps))


def _describe(missing: list[str]) -> str:
    """The missing files and whose shards they held."""
    ranks = sorted({rank for name in missing if (rank := writer_of_data_file(name)) is not None})
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    whose = f" (the shards saved by rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))})" \
        if ranks else ""
    return f"{shown}{whose}"
