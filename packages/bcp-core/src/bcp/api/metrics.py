"""One record per save or load: every rank's phase timeline, bytes, error and place in the topology.

Each rank's :class:`RankRecord` travels to the coordinating rank on an exchange the operation makes
anyway (the commit exchange of the writer door; a load's final agreement), so monitoring adds no
collective. The coordinating rank assembles the :class:`OpRecord`, keeps it on the handle or result,
logs a one-line summary under the ``bcp`` logger and adds it to the metrics log (on by default)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping

from bcp.api import log_output
from bcp.api.metrics_log import append_record
from bcp.api.phase_stats import PhaseStats
from bcp.engine.location import Location
from bcp.storage.retry import RetryStats
from bcp.version import __version__

logger = logging.getLogger("bcp")
log_output.install(logger)


@dataclass(slots=True)
class RankRecord:
    """What one rank did: its phases as (name, start, end) in seconds since the epoch, in the order
    they began (a phase before its parts), the bytes it
    wrote or read (of them, values' bytes; and the bytes received from other ranks), its error if
    it failed, and where it runs."""

    rank: int
    host: str
    local_rank: int | None
    topology: dict[str, int]
    phases: list[tuple[str, float, float]]
    bytes: int = 0
    received_bytes: int = 0
    error: str | None = None
    #: Storage requests retried during the operation, by cause (backends that retry, as s3:// does).
    retries: dict[str, int] = field(default_factory=dict)
    #: Of ``bytes``, those of values; None in records of bcp versions that did not tell them apart.
    value_bytes: int | None = None

    @staticmethod
    def of(rank: int, stats: PhaseStats, topology: Mapping[str, int] | None,
           retries: Mapping[str, int] | None = None) -> "RankRecord":
        local = os.environ.get("LOCAL_RANK")
        return RankRecord(rank, socket.gethostname(), int(local) if local is not None else None,
                          dict(topology or {}), sorted(stats.spans, key=lambda span: (span[1], -span[2])),
                          stats.bytes, stats.received_bytes,
                          retries=dict(retries or {}), value_bytes=stats.value_bytes)

    @property
    def tensor_bytes(self) -> int | None:
        """Of ``bytes``, those of tensors (None where values' bytes were not recorded)."""
        return None if self.value_bytes is None else self.bytes - self.value_bytes

    def seconds(self) -> dict[str, float]:
        """Seconds per phase (a phase run twice counts twice)."""
        out: dict[str, float] = {}
        for name, start, end in self.phases:
            out[name] = out.get(name, 0.0) + end - start
        return out

    def to_wire(self) -> dict[str, Any]:
        """What travels to the coordinating rank: the record's JSON form, by field name."""
        return self.to_json()

    @staticmethod
    def from_wire(wire: Mapping[str, Any]) -> "RankRecord":
        return RankRecord.from_json(wire)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "local_rank": self.local_rank, "topology": self.topology,
                "phases": [{"name": n, "start": s, "end": e} for n, s, e in self.phases], "bytes": self.bytes,
                "tensor_bytes": self.tensor_bytes, "value_bytes": self.value_bytes,
                "received_bytes": self.received_bytes, "error": self.error, "retries": self.retries}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "RankRecord":
        return RankRecord(data["rank"], data.get("host", ""), data.get("local_rank"), dict(data.get("topology") or {}),
                          [(p["name"], p["start"], p["end"]) for p in data.get("phases", [])], data.get("bytes", 0),
                          data.get("received_bytes", 0), data.get("error"), dict(data.get("retries") or {}),
                          data.get("value_bytes"))


@dataclass(slots=True)
class OpRecord:
    """One save or load: ``ok``, or the phase it failed in and the error (which names the failing
    ranks); ``blocking_seconds`` is how long the caller waited (an async save: until staged)."""

    op: str
    path: str
    generation: int | None
    world_size: int
    start: float
    seconds: float
    blocking_seconds: float
    ok: bool = True
    failed_phase: str | None = None
    error: str | None = None
    ranks: list[RankRecord] = field(default_factory=list)
    version: str = __version__

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.ranks)

    @property
    def value_bytes(self) -> int | None:
        """Of ``bytes``, those of values (None where a rank's record does not say)."""
        counts = [r.value_bytes for r in self.ranks]
        return None if None in counts else sum(counts)

    @property
    def title(self) -> str:
        """``bcp save /ckpt generation 42``; without the generation where none was reached (a load
        that failed before reading one)."""
        generation = "" if self.generation is None else f" generation {self.generation}"
        return f"bcp {self.op} {self.path}{generation}"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "path": self.path, "generation": self.generation, "world_size": self.world_size,
                "start": self.start, "seconds": self.seconds, "blocking_seconds": self.blocking_seconds,
                "bytes": self.bytes, "value_bytes": self.value_bytes, "ok": self.ok, "failed_phase": self.failed_phase, "error": self.error,
                "version": self.version, "ranks": [r.to_json() for r in self.ranks]}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "OpRecord":
        return OpRecord(data["op"], data["path"], data.get("generation"), data["world_size"], data["start"],
                        data["seconds"], data.get("blocking_seconds", data["seconds"]), data.get("ok", True),
                        data.get("failed_phase"), data.get("error"),
                        [RankRecord.from_json(r) for r in data.get("ranks", [])], data.get("version", ""))


class Monitor:
    """An operation's record in the making, on every rank; the coordinating rank (rank 0) finishes it."""

    def __init__(self, op: str, rank: int, world_size: int, stats: PhaseStats, topology: Mapping[str, int] | None,
                 metrics_log: "bool | str | os.PathLike", summary_level: int = logging.INFO) -> None:
        self.op, self.rank, self.world_size, self.stats = op, rank, world_size, stats
        self.topology, self.metrics_log, self.summary_level = topology, metrics_log, summary_level
        self.start = stats.now()
        self.blocking_seconds: float | None = None
        self.location: Location | None = None
        self.generation: int | None = None
        self._retries_before: dict[str, int] = {}
        self._asked: Any = None  # the path as the caller gave it, for a failure before it was resolved
        #: The finished record (rank 0 only).
        self.record: OpRecord | None = None

    def begin(self, path: Any) -> None:
        """Before any I/O on ``path``: a storage object given by the caller may have counted retries
        of earlier operations (one made from a URL here starts from zero)."""
        self._retries_before = _retry_counts(path)
        self._asked = path

    def _retries(self) -> dict[str, int]:
        now = _retry_counts(self.location.storage) if self.location is not None else {}
        return {cause: n - self._retries_before.get(cause, 0) for cause, n in now.items()
                if n > self._retries_before.get(cause, 0)}

    def _own(self) -> RankRecord:
        return RankRecord.of(self.rank, self.stats, self.topology, self._retries())

    def returned(self) -> None:
        """The caller got control back (an async save: staged); the blocking time ends here."""
        self.blocking_seconds = self.stats.now() - self.start

    def rank_wire(self) -> list[Any]:
        """This rank's record as it travels to rank 0."""
        return self._own().to_wire()

    def finish(self, every_rank: list[list[Any]]) -> None:
        """Rank 0: the operation succeeded; ``every_rank`` are the ranks' wires, rank 0's replaced by
        its complete record (its phases after the exchange included)."""
        ranks = [RankRecord.from_wire(wire) for wire in every_rank]
        ranks[0] = self._own()
        self._close(ranks)

    def fail(self, phase: str | None, error: BaseException) -> None:
        """Rank 0: the operation failed in ``phase``; the other ranks' records did not arrive."""
        if self.record is not None or self.rank != 0:
            return
        own = self._own()
        own.error = f"{type(error).__name__}: {error}"
        spans = self.stats.spans  # an error that surfaced in an exchange between phases: after the last one
        where = phase or self.stats.failed_phase or (spans[-1][0] if spans else "start")
        self._close([own], where, own.error)

    def _close(self, ranks: list[RankRecord], failed_phase: str | None = None, error: str | None = None) -> None:
        seconds = self.stats.now() - self.start
        blocking = self.blocking_seconds if self.blocking_seconds is not None else seconds
        path = self.location.display if self.location is not None else _shown(self._asked)
        self.record = record = OpRecord(self.op, path, self.generation, self.world_size, self.start, seconds,
                                        blocking, error is None, failed_phase, error, ranks)
        if error is None:
            logger.log(self.summary_level, "%s: %d bytes in %.3f s (%s), blocking %.3f s, %d rank(s)",
                       record.title, record.bytes, seconds, transfer_rate(record.bytes, seconds), blocking,
                       self.world_size)
        else:
            logger.warning("%s failed in phase %s: %s", record.title, failed_phase, error)
        if self.metrics_log and self.location is not None:
            append_record(self.location, self.metrics_log, record.to_json())


def transfer_rate(nbytes: int, seconds: float) -> str:
    """Bytes per second in the decimal unit that keeps three significant digits (``5.72 GB/s``,
    ``410 kB/s``): a small transfer does not read ``0.00 GB/s``."""
    rate = nbytes / seconds if seconds > 0 else 0.0
    for unit in ("B/s", "kB/s", "MB/s", "GB/s", "TB/s"):
        if rate < 999.5 or unit == "TB/s":
            return f"{rate:.3g} {unit}"
        rate /= 1000
    raise AssertionError("unreachable")


def _shown(path: Any) -> str:
    """A path or URL as given; a storage object by its root."""
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path)
    return str(getattr(path, "root", "") or "")


def _retry_counts(storage: Any) -> dict[str, int]:
    stats = getattr(storage, "stats", None)
    return dict(stats.snapshot()["retries"]) if isinstance(stats, RetryStats) else {}
