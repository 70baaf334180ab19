"""The plan cache: a save whose structure (tensors, dtypes, shapes, boxes on every rank) is the same
as the previous save's reuses its global plan, skipping the gather of local plans (paper 4.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bcp.layout.write_plan import RankAssignment
from bcp.planning.save_plan import PlanColumns


@dataclass
class CachedPlan:
    #: This rank's structure (``save_plan.structure_key``) the plan was made for; compared exactly, never hashed.
    structure: Any
    #: This rank's share of the global plan.
    writes: RankAssignment
    #: Every rank's pieces, kept on the coordinating rank only (it assembles manifests).
    columns: PlanColumns | None
    #: Which plain tensors were tensor entries (``plain_tensors.kinds_digest``): the plan holds only
    #: for saves where the same ones are.
    kinds: int = 0


class PlanCache:
    """One cached plan per coordinator channel (world, rank and process group)."""

    def __init__(self) -> None:
        self._entries: dict[Any, CachedPlan] = {}

    def get(self, key: Any, structure: Any) -> CachedPlan | None:
        entry = self._entries.get(key)
        return entry if entry is not None and entry.structure == structure else None

    def put(self, key: Any, plan: CachedPlan) -> None:
        self._entries[key] = plan

    def clear(self) -> None:
        self._entries.clear()
