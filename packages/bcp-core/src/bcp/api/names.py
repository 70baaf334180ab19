"""Matching the names a load wants against the names a checkpoint holds, under ``strict``.

A name wanted but not saved is missing on the rank that wants it. A saved name is unexpected only
when no rank wants it: with pipeline stages (or any layout where ranks hold different tensors) each
rank wants its own stage's names, and the checkpoint holds every stage's. Ranks whose own view
finds no saved name left over settle it alone; otherwise the ranks pool what they want in one
exchange (indices into the sorted saved names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bcp.api.checkpoint import Checkpoint
from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, gather_then_reply
from bcp.errors import MismatchError

_LISTED = 20  # names shown in a strict-mode error before "and N more"


@dataclass(slots=True)
class NameMatch:
    """This rank's view: the saved names it loads, the wanted names the checkpoint lacks, and the
    saved names of its components that it does not want (``left_over``)."""

    loaded: list[str]
    missing: list[str]
    left_over: list[str]
    components: list[str]


def match_names(wanted: dict[str, Any], checkpoint: Checkpoint, strict: bool) -> NameMatch:
    components = sorted({name.split("/", 1)[0] for name in wanted})
    saved = {n for n in [*checkpoint.tensors, *checkpoint.objects] if n.split("/", 1)[0] in components}
    missing = sorted(set(wanted) - saved)
    left_over = sorted(saved - set(wanted))
    if strict and missing:
        also = f"; in the checkpoint but not wanted on this rank: {listing(left_over)}" if left_over else ""
        raise MismatchError(f"strict load: missing from the checkpoint: {listing(missing)}{also} (pass strict=False "
                            "to load the overlap)", path=checkpoint.path)
    return NameMatch([name for name in wanted if name in saved], missing, left_over, components)


def unexpected_across_ranks(coord: Coordinator, match: Outcome, checkpoint: Checkpoint) -> list[str]:
    """Collective: the saved names of components some rank asked for that no rank wants."""
    names = sorted([*checkpoint.tensors, *checkpoint.objects])
    index = {name: i for i, name in enumerate(names)}

    def pooled(every_rank: list[Any]) -> list[Any]:
        wanted = np.zeros(len(names), dtype=bool)
        components: set[str] = set()
        for loaded, asked in every_rank:
            wanted[np.frombuffer(loaded, dtype=np.int64)] = True
            components.update(asked)
        left = [i for i in np.flatnonzero(~wanted).tolist() if names[i].split("/", 1)[0] in components]
        return [np.array(left, dtype=np.int64).tobytes()] * len(every_rank)

    mine = None
    if match.error is None:
        mine = [np.array([index[n] for n in match.value.loaded], dtype=np.int64).tobytes(), match.value.components]
    left = gather_then_reply(coord, Outcome(mine, match.error), pooled, f"matching names in {checkpoint.path}")
    return [names[i] for i in np.frombuffer(left, dtype=np.int64).tolist()]


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")
