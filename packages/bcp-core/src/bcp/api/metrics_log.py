"""The metrics log: one JSON line per operation, appended whole so that it can be read while the
job runs. It lies beside the checkpoints (``<path>/bcp-metrics.jsonl``) or in a file the user names.
Writing it never fails an operation: a log that cannot be written is a warning."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator, Mapping

from bcp.engine.location import Location
from bcp.storage import LocalStorage

METRICS_LOG = "bcp-metrics.jsonl"

logger = logging.getLogger("bcp")


def append_record(location: Location, target: "bool | str | os.PathLike", record: Mapping[str, Any]) -> None:
    """Append ``record`` as one line to the log ``target`` names (``True``: beside the checkpoints)."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    try:
        if target is True:
            _append_to_storage(location, f"{location.prefix}{METRICS_LOG}", line)
        else:
            _append_to_file(os.fspath(target), line)
    except OSError as exc:
        logger.warning("bcp: could not append to the metrics log of %s: %s", location.display, exc)


def _append_to_file(path: str, line: bytes) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)  # one write of the whole line with O_APPEND: readers see whole lines
    finally:
        os.close(fd)


def _append_to_storage(location: Location, name: str, line: bytes) -> None:
    storage = location.storage
    if isinstance(storage, LocalStorage):
        _append_to_file(os.path.join(storage.root, *name.split("/")), line)
        return
    # Object stores cannot append: the log is rewritten whole, which they replace atomically.
    old = storage.read_bytes(name) if storage.exists(name) else b""
    storage.write_file(name, [memoryview(old + line)])


def read_records(path: "str | os.PathLike") -> Iterator[dict[str, Any]]:
    """The records of a metrics log file, or of the log beside the checkpoints at directory ``path``;
    a last line still being written is skipped."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_LOG)
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if line.endswith("\n") and line.strip():
                yield json.loads(line)
