"""The plan step of ``bcp.save``: every rank's :class:`Proposal` (what it collected, in digests) to
every rank, rank 0's claim of the generation, and the :class:`AgreedPlan` each rank writes from."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from bcp.adapters.dataloader import check_writers
from bcp.api.runtime import Runtime
from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, all_agree, gather_then_reply
from bcp.engine.location import Location
from bcp.wire_records import WireRecord
from bcp.errors import CheckpointError
from bcp.layout.local_plan import LocalPlan
from bcp.layout.piece import Piece
from bcp.layout.write_plan import RankAssignment, ValueWrite
from bcp.planning import plain_tensors
from bcp.planning.pieces import pieces_of
from bcp.planning.plain_tensors import PlainTensor
from bcp.planning.plan_cache import CachedPlan
from bcp.planning.reuse import FrozenParameters
from bcp.planning.save_plan import PlanColumns, global_plan
from bcp.planning.shared_values import digests

#: A tensor a rank declares: name, torch dtype, global shape.
Declared = tuple[str, Any, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class PlannedPiece:
    """A piece a rank plans, with its chunk checksums where known and, where replicas are verified, its crc32c."""

    piece: Piece
    crcs: list[int] | None = None
    replica_crc: int | None = None


@dataclass(slots=True)
class Collected:
    """A rank's state as the planner sees it: tensor declarations, pieces and value records, the
    plain tensors (tensor entries or per-rank tensors, decided with every rank's digests) and the
    structure key the plan cache compares."""

    tensors: list[Declared]
    pieces: list[PlannedPiece]
    values: list[ValueWrite]
    plain: list[PlainTensor]
    #: Whether the save checks, by checksum, that replicated tensors agree across ranks.
    verify_replicas: bool
    structure: tuple
    framework: str
    #: The rank's word on its dataloader parts (``DataloaderState.declaration``), None without one.
    dataloader: list[int] | None
    #: An incremental save's frozen parameters (``planning.reuse``), None where they are not trusted.
    frozen: FrozenParameters | None = None

    def with_entries(self, entries: set[str]) -> "Share":
        """Everything this rank plans once the plain tensors in ``entries`` are tensor entries."""
        chosen = [t for t in self.plain if t.name in entries]
        pieces = [PlannedPiece(p, t.crcs, t.digest & 0xFFFFFFFF if self.verify_replicas else None)
                  for t in chosen for p in pieces_of(t.name, t.tensor)]
        per_rank = [plain_tensors.per_rank_value(t) for t in self.plain if t.name not in entries]
        return Share(self.tensors + [(t.name, t.tensor.dtype, tuple(t.tensor.shape)) for t in chosen],
                     self.pieces + pieces, self.verify_replicas, self.values + per_rank)


@dataclass(frozen=True, slots=True)
class Share:
    """What a rank plans and writes: declarations, pieces and value records."""

    tensors: list[Declared]
    pieces: list[PlannedPiece]
    verify_replicas: bool
    values: list[ValueWrite]

    def local_plan(self) -> list[Any]:
        replica_crcs = [p.replica_crc for p in self.pieces] if self.verify_replicas else None
        return LocalPlan.of(self.tensors, [p.piece for p in self.pieces], replica_crcs).to_wire()


@dataclass(frozen=True, slots=True)
class Proposal(WireRecord):
    """A rank's word on the plan: whether its cached plan still fits (and for which kinds of plain
    tensors it was made), (rank 0) the generation, a digest of the checkpoint it names and what it
    declares of its dataloader parts (the last two checked by every rank before anything is
    written), a digest of each of its per-rank values (identical ones are written once,
    ``planning.shared_values``) and of each of its plain tensors (``planning.plain_tensors``). For
    an incremental save: (rank 0) the base generation and whether its claim was this process's, and
    the generations this rank remembers saving at the path (``planning.reuse_memory``)."""

    cache_hit: bool
    cached_kinds: int | None
    generation: int | None
    target_digest: int
    dataloader: list[int] | None
    values: list[list[Any]]
    plain: list[list[Any]]
    base: int | None = None
    continuous: bool = False
    remembered: list[int] | None = None


@dataclass(frozen=True, slots=True)
class Base:
    """An incremental save's base: the newest committed generation at the path when the save
    claimed its own (None: there is none, or the save is not incremental), and whether every rank
    remembers what it stored there (else the base's manifest says)."""

    generation: int | None = None
    remembered: bool = False


@dataclass(frozen=True, slots=True)
class AgreedPlan:
    """What every rank agreed on: the generation to write, the global plan (this rank's part in it),
    what this rank plans, every rank's value digests (identical values are written once) and an
    incremental save's base."""

    generation: int
    plan: CachedPlan
    share: Share
    value_digests: list[list[list[Any]]]
    base: Base


def agree_on_plan(coord: Coordinator, location: Location, place: Any, collected: Outcome, rt: Runtime, cache: bool,
                  incremental: bool) -> AgreedPlan:
    """Collective: the plan of the save of ``collected`` (``place``: the path and process group, as
    the incremental saves' memory knows them). Which plain tensors are tensor
    entries follows from every rank's digests of them. When every rank's structure is unchanged
    since the previous save, and its plain tensors are of the same kinds, the cached global plan is
    reused after one small exchange (every rank's hit flag, and rank 0's generation, to every
    rank); otherwise local plans are gathered and planned again."""
    key = coord.cache_key()
    structure = collected.value.structure if cache and collected.error is None else None
    hit = rt.plan_cache.get(key, structure) if structure is not None else None
    what = f"planning the save of {location.display}"

    def propose() -> dict[str, Any]:
        if collected.error is not None:
            raise collected.error
        generation, base, continuous = _claim(location, rt, incremental) if coord.rank == 0 else (None, None, False)
        return Proposal(hit is not None, hit.kinds if hit is not None else None, generation,
                        _digest(location.target), collected.value.dataloader,
                        digests(collected.value.values), plain_tensors.digests(collected.value.plain),
                        base, continuous, rt.reuse.generations(place)).to_wire()

    proposals = [Proposal.from_wire(wire) for wire in all_agree(coord, Outcome.of(propose), what)]
    try:  # every rank holds every proposal, so every rank raises the same error here
        if len({proposal.target_digest for proposal in proposals}) > 1:  # every rank sees it: collective
            _refuse_targets(all_agree(coord, Outcome(location.target), what))
        check_writers([proposal.dataloader for proposal in proposals])
    except CheckpointError as exc:
        raise exc.at(location.display)
    first = proposals[0]
    base = Base(first.base, first.base is not None and first.continuous
                and all(first.base in p.remembered for p in proposals))
    entries = plain_tensors.same_everywhere([proposal.plain for proposal in proposals])
    kinds = plain_tensors.kinds_digest(entries)
    value_digests = [proposal.values + [pair for pair in proposal.plain if pair[0] not in entries]
                     for proposal in proposals]
    share = Outcome.of(lambda: collected.value.with_entries(entries))
    if share.error is None and all(proposal.cache_hit and proposal.cached_kinds == kinds for proposal in proposals):
        return AgreedPlan(first.generation, hit, share.value, value_digests, base)
    kept: dict[str, PlanColumns] = {}

    def plan_globally(plans: list[Any]) -> list[Any]:
        kept["columns"] = columns = PlanColumns([LocalPlan.from_wire(plan) for plan in plans])
        return [assignment.to_wire() for assignment in global_plan(columns)]

    local = Outcome.of(lambda: share.value.local_plan()) if share.error is None else share
    wire = gather_then_reply(coord, local, plan_globally, what)
    planned = CachedPlan(structure, RankAssignment.from_wire(wire), kept.get("columns"), kinds)
    if cache:
        rt.plan_cache.put(key, planned)
    return AgreedPlan(first.generation, planned, share.value, value_digests, base)


def _claim(location: Location, rt: Runtime, incremental: bool) -> tuple[int, int | None, bool]:
    """(Rank 0) the generation claimed, the base of an incremental save, and whether the base's
    claim is one this process made (its saves' memory is then the base's)."""
    base = location.newest_committed() if incremental else None
    generation, token = location.claim(base)
    if not incremental:
        return generation, None, False
    rt.reuse.claimed(location.target, generation, token)
    mine = rt.reuse.claim_token(location.target, base) if base is not None else None
    return generation, base, mine is not None and mine == location.claim_token(base)


def _digest(target: str) -> int:
    """The checkpoint a rank names, in 8 bytes: what every save's plan exchange carries (the names
    themselves travel only when the digests differ)."""
    return int.from_bytes(hashlib.blake2b(target.encode(), digest_size=8).digest(), "big")


def _refuse_targets(targets: list[str]) -> None:
    """Every rank must name the same checkpoint: ranks writing their shares to different places would
    commit a generation whose files are elsewhere (found only when it is loaded)."""
    named = {target: [rank for rank, t in enumerate(targets) if t == target] for target in targets}
    listed = "; ".join(f"ranks {ranks}: {target}" for target, ranks in named.items())
    raise CheckpointError(f"the ranks of one save name different checkpoints ({listed}): every rank "
                          "must pass the same path or URL (and role)")
