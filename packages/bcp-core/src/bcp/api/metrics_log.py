"""The metrics log: one JSON line per operation, readable while the job runs.

Beside the checkpoints (the default) it is a folder, ``<path>/bcp-metrics/``, of one object per
operation, named so that name order is start order: object stores cannot append, and an object of its
own per operation needs no read-modify-write, so concurrent savers and loaders never lose or
interleave each other's records. Each object is created whole (create-if-absent), so a reader sees
complete records only. A local file the user names instead gets one ``O_APPEND`` write per line.

Beside the checkpoints the log follows the checkpoint's retention: each commit, after removing the
generations it no longer keeps, removes the records of operations on them (``prune_records``), so the
log holds about ``keep_generations`` save intervals of history, not every operation ever.

Writing the log never fails an operation. A load that cannot write beside the checkpoint it read (a
read-only folder, a bucket it may only read) skips the log with a DEBUG message; any other failure to
write it is a warning."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import uuid
from typing import Any, Iterator, Mapping

from bcp.api.location import resolve
from bcp.engine.location import CLAIM, METRICS_DIR, Location
from bcp.layout.markers import Claim
from bcp.errors import CheckpointError
from bcp.storage import Storage

_SUFFIX = ".jsonl"

logger = logging.getLogger("bcp")


def append_record(location: Location, target: "bool | str | os.PathLike", record: Mapping[str, Any]) -> None:
    """Add ``record`` to the log ``target`` names (``True``: beside the checkpoints at ``location``)."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    beside_a_load = target is True and record.get("op") == "load"
    try:
        if target is True:
            with _storage_errors_unlogged() if beside_a_load else contextlib.nullcontext():
                _put_record(location, record, line)
        else:
            _append_to_file(os.fspath(target), line)
    except (OSError, CheckpointError) as exc:
        if beside_a_load:
            logger.debug("bcp: no metrics log for this load of %s (cannot write beside it: %s)",
                         location.display, exc)
        else:
            logger.warning("bcp: could not write the metrics log of %s: %s", location.display, exc)


def _put_record(location: Location, record: Mapping[str, Any], line: bytes) -> None:
    # Microseconds since the epoch, zero-padded: name order is start order (for a century or two).
    # The generation in the name lets retention prune without reading the records.
    generation = record.get("generation")
    stem = (f"{location.prefix}{METRICS_DIR}/{round(record['start'] * 1e6):017d}-{record['op']}"
            f"{f'-g{generation}' if isinstance(generation, int) else ''}")
    while not location.storage.put_if_absent(f"{stem}-{uuid.uuid4().hex[:8]}{_SUFFIX}", line):
        pass  # the same microsecond and the same random tag: draw another


def prune_records(location: Location, oldest: int) -> None:
    """After a commit's retention, which kept generations from ``oldest`` on: remove the records of
    operations on older generations (a record without a generation: when it started before
    ``oldest`` was claimed)."""
    claim = Claim.from_json(location.storage.read_bytes(location.name(oldest, CLAIM)))
    claimed = claim.unix if claim is not None else None
    folder = f"{location.prefix}{METRICS_DIR}"
    for name in location.storage.list_dir(folder):
        fields = name[:-len(_SUFFIX)].split("-")
        on = next((int(f[1:]) for f in fields[2:-1] if f[:1] == "g" and f[1:].isdigit()), None)
        started = int(fields[0]) if fields[0].isdigit() else None
        if (on is not None and on < oldest) or (on is None and started is not None and claimed is not None
                                                and started < claimed * 1e6):
            location.storage.delete_tree(f"{folder}/{name}")


@contextlib.contextmanager
def _storage_errors_unlogged() -> Iterator[None]:
    """The storage layer logs a request that failed for good before raising it. Where a load may only
    read, its log write failing is expected, not an error: this thread's storage records are dropped
    meanwhile (other threads', an async save's among them, still pass)."""
    this_thread = threading.get_ident()

    def other_threads(record: logging.LogRecord) -> bool:
        return record.thread != this_thread

    storage_logger = logging.getLogger("bcp.storage")
    storage_logger.addFilter(other_threads)
    try:
        yield
    finally:
        storage_logger.removeFilter(other_threads)


def _append_to_file(path: str, line: bytes) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)  # one write of the whole line with O_APPEND: readers see whole lines
    finally:
        os.close(fd)


def read_records(source: "str | os.PathLike | Storage") -> Iterator[dict[str, Any]]:
    """The records, oldest first, of a metrics log file, or of the log beside the checkpoints at
    ``source`` (a folder, a URL of any backend, or a storage); a record still being written is
    skipped. ``FileNotFoundError`` when there is no log."""
    if not isinstance(source, Storage) and os.path.isfile(source):
        with open(source, encoding="utf-8") as lines:
            yield from _parsed(lines)
        return
    location = resolve(source, None)
    names = [n for n in location.storage.list_dir(METRICS_DIR) if n.endswith(_SUFFIX)]
    if not names:
        raise FileNotFoundError(2, "no metrics log", f"{location.display}/{METRICS_DIR}")
    for name in names:
        try:
            data = location.storage.read_bytes(f"{METRICS_DIR}/{name}")
        except FileNotFoundError:
            continue  # removed since listed (the checkpoint folder was deleted)
        yield from _parsed(data.decode("utf-8").splitlines(keepends=True))


def _parsed(lines: Any) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.endswith("\n") and line.strip():
            yield json.loads(line)
