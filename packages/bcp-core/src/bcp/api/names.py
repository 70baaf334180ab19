"""Matching the names a load wants against the names a checkpoint holds, under ``strict``.

A name wanted but not saved is missing on the rank that wants it. A saved name is unexpected only
when no rank wants it: with pipeline stages (or any layout where ranks hold different tensors) each
rank wants its own stage's names, and the checkpoint holds every stage's. Ranks whose own view
finds no saved name left over settle it alone; otherwise the ranks pool what they want in one
exchange (indices into the sorted saved names).

A mismatch is answered with both sides (what is missing, what the checkpoint holds that was not
asked for, whole components counted rather than listed), the saved names closest to the missing
ones, and ``strict=False`` offered only where it would load something. A non-strict load that
matches nothing warns: it would otherwise succeed having loaded nothing."""

from __future__ import annotations

import difflib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Collection

import numpy as np

from bcp.api.checkpoint import Checkpoint
from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, all_agree, gather_then_reply
from bcp.errors import MismatchError

logger = logging.getLogger("bcp")

_LISTED = 20  # names shown in a mismatch before "and N more"
_SUGGESTED = 5  # missing names (or components) for which the closest saved ones are looked up


@dataclass(slots=True)
class NameMatch:
    """This rank's view: the saved names it loads, the wanted names the checkpoint lacks, and the
    saved names of its components that it does not want (``left_over``)."""

    loaded: list[str]
    missing: list[str]
    left_over: list[str]
    components: list[str]


def match_names(wanted: dict[str, Any], checkpoint: Checkpoint, strict: bool) -> NameMatch:
    """This rank's names against the checkpoint's; a strict load missing any raises, a non-strict
    load that matches nothing warns."""
    components = sorted({component_of(name) for name in wanted})
    saved = {n for n in [*checkpoint.tensors, *checkpoint.objects] if component_of(n) in components}
    missing = sorted(set(wanted) - saved)
    left_over = sorted(saved - set(wanted))
    loaded = [name for name in wanted if name in saved]
    if strict and missing:
        raise MismatchError(f"strict load: {describe_mismatch(missing, left_over, loaded, checkpoint)}",
                            path=checkpoint.path)
    if wanted and not loaded:
        logger.warning("bcp load %s: strict=False and no name of the state is in the checkpoint, so nothing "
                       "is loaded: %s", checkpoint.path, describe_mismatch(missing, left_over, loaded, checkpoint,
                                                                          advice=False))
    return NameMatch(loaded, missing, left_over, components)


@dataclass(slots=True)
class Unloaded:
    """The saved names that no rank loads: all of them (``LoadResult.unexpected``), and those in a
    component some rank asked for (what ``strict`` refuses)."""

    every: list[str]
    in_requested: list[str]


def unloaded_across_ranks(coord: Coordinator, match: Outcome, checkpoint: Checkpoint) -> Unloaded:
    """Collective: the saved names that no rank loads. One exchange, skipped where no rank has
    names of its components left over and every rank asked for the same components (the saved
    names outside them are then the unloaded ones on every rank)."""
    names = sorted([*checkpoint.tensors, *checkpoint.objects])
    views = all_agree(coord, Outcome(None if match.error is not None or match.value is None else
                                     [bool(match.value.left_over), match.value.components], match.error),
                      f"loading {checkpoint.path}")
    views = [view for view in views if view is not None]
    if not views:
        return Unloaded([], [])
    if not any(left for left, _ in views) and all(components == views[0][1] for _, components in views):
        asked = set(views[0][1])
        return Unloaded([name for name in names if component_of(name) not in asked], [])
    return _pooled_unloaded(coord, match, checkpoint, names)


def _pooled_unloaded(coord: Coordinator, match: Outcome, checkpoint: Checkpoint, names: list[str]) -> Unloaded:
    """Collective: every rank's loaded names and requested components pooled on rank 0."""
    index = {name: i for i, name in enumerate(names)}

    def pooled(every_rank: list[Any]) -> list[Any]:
        wanted = np.zeros(len(names), dtype=bool)
        components: set[str] = set()
        for loaded, asked in every_rank:
            wanted[np.frombuffer(loaded, dtype=np.int64)] = True
            components.update(asked)
        left = np.flatnonzero(~wanted).tolist()
        requested = [i for i in left if component_of(names[i]) in components]
        return [[np.array(left, dtype=np.int64).tobytes(), np.array(requested, dtype=np.int64).tobytes()]] \
            * len(every_rank)

    mine = [np.array([index[n] for n in match.value.loaded], dtype=np.int64).tobytes(), match.value.components]
    every, requested = gather_then_reply(coord, Outcome(mine), pooled, f"matching names in {checkpoint.path}")
    return Unloaded(*([names[i] for i in np.frombuffer(raw, dtype=np.int64).tolist()] for raw in (every, requested)))


def unexpected_error(unexpected: list[str], checkpoint: Checkpoint) -> MismatchError:
    """The strict load's error for saved names of requested components that no rank wants (every
    wanted name was found, so the rest loads)."""
    return MismatchError(f"strict load: in the checkpoint but wanted by no rank: {listing(unexpected)} "
                         "(pass strict=False to load the rest)", path=checkpoint.path)


def describe_mismatch(missing: list[str], left_over: list[str], loaded: Collection[str], checkpoint: Checkpoint,
                      *, advice: bool = True) -> str:
    """Both sides of a mismatch on this rank, the closest saved names and, with ``advice``, what
    ``strict=False`` would load."""
    asked = {component_of(name) for name in [*missing, *loaded]}
    every = sorted([*checkpoint.tensors, *checkpoint.objects])
    saved = Counter(component_of(name) for name in every)
    unasked = [name for name in every if component_of(name) not in asked]
    parts = [f"missing from the checkpoint: {_summary(missing, saved)}"]
    if left_over:
        parts.append(f"in the checkpoint but not wanted on this rank: {listing(left_over)}")
    if unasked:
        parts.append(f"in components the state does not ask for: {_by_component(unasked)}")
    hints = _closest(missing, left_over, saved, {component_of(name) for name in unasked})
    if hints:
        parts.append("did you mean " + ", ".join(f"{close!r} for {name!r}" for name, close in hints) + "?")
    if advice and loaded:
        parts.append(f"pass strict=False to load what matches ({_entries(len(loaded))})")
    elif advice:
        parts.append("no name of the state is in the checkpoint, so strict=False would load nothing")
    return "; ".join(parts)


def component_of(name: str) -> str:
    return name.split("/", 1)[0]


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _summary(missing: list[str], saved: Counter) -> str:
    """The missing names, each component the checkpoint lacks entirely counted as one item."""
    absent = Counter(component_of(name) for name in missing if component_of(name) not in saved)
    if not absent or len(missing) <= _LISTED // 2:
        return listing(missing)
    named = [name for name in missing if component_of(name) in saved]
    whole = [f"all {_entries(count)} of component {component!r}" for component, count in sorted(absent.items())]
    return ", ".join(whole) + (f"; {listing(named)}" if named else "")


def _closest(missing: list[str], left_over: list[str], saved: Counter,
             unasked: set[str]) -> list[tuple[str, str]]:
    """(missing, closest saved) pairs: a component the checkpoint lacks against the saved
    components nobody asked for, a name within a saved component against its left-over names."""
    pairs: list[tuple[str, str]] = []
    absent = sorted({component_of(name) for name in missing if component_of(name) not in saved})
    for component in absent[:_SUGGESTED]:
        pairs.extend((component, close) for close in difflib.get_close_matches(component, sorted(unasked), n=1))
    within = [name for name in missing if component_of(name) in saved]
    for name in within[:_SUGGESTED]:
        pairs.extend((name, close) for close in difflib.get_close_matches(name, left_over, n=1))
    return pairs


def _by_component(names: list[str]) -> str:
    """``names`` (sorted) listed, or where there are many, counted per component with a few of each."""
    if len(names) <= _LISTED:
        return ", ".join(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(component_of(name), []).append(name)
    return ", ".join(f"{component} ({_entries(len(group))}: {', '.join(group[:3])}{', ...' if len(group) > 3 else ''})"
                     for component, group in groups.items())


def _entries(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"
