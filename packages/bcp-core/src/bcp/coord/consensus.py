"""Error consensus: every exchange carries each rank's success or failure, so a failure anywhere
is raised on every rank at the next exchange, with every failing rank's message, and no rank is
left waiting in a collective that the failed rank will never join."""

from __future__ import annotations

from typing import Any, Callable

import msgpack

import bcp.errors as errors
from bcp.coord.base import Coordinator


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


class Outcome:
    """One rank's result of a phase: a plain-data value, or the exception it raised."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value = value
        self.error = error

    @staticmethod
    def of(work: Callable[[], Any]) -> "Outcome":
        try:
            return Outcome(work())
        except Exception as exc:
            return Outcome(error=exc)

    def packed(self, rank: int) -> bytes:
        if self.error is None:
            return pack([True, self.value])
        return pack([False, [_describe(rank, self.error)]])


def all_agree(coord: Coordinator, local: Outcome, what: str) -> list[Any]:
    """Every rank's value; if any rank failed, every rank raises the same report."""
    messages = [unpack(m) for m in _exchange(what, coord.all_gather_bytes, local.packed(coord.rank))]
    failures = [f for ok, body in messages if not ok for f in body]
    if failures:
        raise _error(coord, failures, local.error, what)
    return [body for _, body in messages]


def gather_then_reply(coord: Coordinator, local: Outcome,
                      produce: Callable[[list[Any]], list[Any]], what: str,
                      on_gathered: Callable[[], None] | None = None) -> Any:
    """Rank 0 gathers every rank's value and ``produce`` turns them into one reply per rank; each
    rank returns its reply. A failure on any rank, or in ``produce``, is raised on every rank.
    ``on_gathered`` is called on rank 0 once it holds every rank's outcome (whatever follows)."""
    gathered = _exchange(what, coord.gather_bytes, local.packed(coord.rank))
    own_error = local.error
    parts = None
    if gathered is not None:
        if on_gathered is not None:
            on_gathered()
        messages = [unpack(m) for m in gathered]
        failures = [f for ok, body in messages if not ok for f in body]
        if not failures:
            try:
                parts = [pack([True, reply]) for reply in produce([body for _, body in messages])]
            except Exception as exc:
                own_error = exc
                failures = [_describe(coord.rank, exc)]
        if failures:
            parts = [pack([False, failures])] * coord.world_size
    ok, body = unpack(_exchange(what, coord.scatter_bytes, parts))
    if not ok:
        raise _error(coord, body, own_error, what)
    return body


def broadcast_from_root(coord: Coordinator, local: Outcome, what: str) -> Any:
    """Rank 0's value on every rank (``local`` matters on rank 0 only); its failure raises everywhere."""
    ok, body = unpack(_exchange(what, coord.broadcast_bytes, local.packed(0) if coord.rank == 0 else None))
    if not ok:
        raise _error(coord, body, local.error if coord.rank == 0 else None, what)
    return body


def _exchange(what: str, send: Callable[[Any], Any], message: Any) -> Any:
    """One coordinator exchange; a failure of the transport itself (a dead or hung rank) is raised
    as a ``DistributedError`` naming the phase it interrupted."""
    try:
        return send(message)
    except Exception as exc:
        raise errors.DistributedError(f"{what} failed: {exc}") from exc


def _describe(rank: int, exc: BaseException) -> list[Any]:
    return [rank, type(exc).__name__, str(exc)]


def _error(coord: Coordinator, failures: list[list[Any]], own: BaseException | None, what: str) -> Exception:
    """This rank's own exception when it is the only failure; otherwise one error listing all
    failing ranks, of the failures' common bcp error class when they share one."""
    if own is not None and all(rank == coord.rank for rank, _, _ in failures):
        if isinstance(own, errors.CheckpointError):
            return own
        wrapped = errors.CheckpointError(f"{what} failed: {type(own).__name__}: {own}")
        wrapped.__cause__ = own
        return wrapped
    names = {name for _, name, _ in failures}
    cls = getattr(errors, names.pop(), None) if len(names) == 1 else None
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
        cls = errors.DistributedError
    detail = "; ".join(f"rank {rank}: {name}: {message}" for rank, name, message in failures)
    error = cls(f"{what} failed on {len(failures)} of {coord.world_size} rank(s): {detail}")
    if own is not None:
        error.__cause__ = own
    return error
