"""A seven-part file written to the real SeaweedFS server through the fault proxy, for the S3 tests
of part-by-part uploads (``test_s3_multipart.py``, ``test_s3_credentials.py``, ``test_s3_tls.py``)."""

from __future__ import annotations

import contextlib
import itertools
import random
import re
import threading
from collections.abc import Iterator

from bcp.storage import RetryPolicy, S3Storage
from bcp.storage.s3 import S3Objects
from s3_fault_proxy import FaultProxy

PART = 5 << 20  # S3's smallest part
SIZE = 6 * PART + 12345  # seven parts, the last one short
RANGE = re.compile(r"/shard\.bin bytes (\d+)-(\d+)")
PART_NUMBER = re.compile(r"[?&]partNumber=(\d+)")


def part_number(method: str, path: str) -> int | None:
    """The part an UploadPart request sends; None for any other request."""
    found = PART_NUMBER.search(path) if method == "PUT" else None
    return int(found.group(1)) if found else None


def seven_part_file() -> tuple[bytes, list[memoryview]]:
    """SIZE random bytes, as buffers of odd sizes so that parts span buffer boundaries."""
    data = random.Random(3).randbytes(SIZE)
    cuts = [0, 1, 7 << 20, 7 << 20, (19 << 20) + 3, SIZE]  # an empty buffer and a one-byte one included
    return data, [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]


def part_ranges() -> set[tuple[int, int]]:
    return {(offset, min(offset + PART, SIZE) - 1) for offset in range(0, SIZE, PART)}


class Recorder:
    """A proxy fault rule that also records which requests it faulted."""

    def __init__(self, rule) -> None:
        self.rule, self.lock, self.faulted, self.seen = rule, threading.Lock(), [], []

    def __call__(self, method: str, path: str) -> str | None:
        with self.lock:
            fault = self.rule(method, path)
            self.seen.append((method, path))
            if fault:
                self.faulted.append((method, path, fault))
            return fault


@contextlib.contextmanager
def proxied_storage(s3_server, s3_url: str, rule, credentials: dict[str, str] | None = None,
                     ) -> Iterator[tuple[S3Storage, FaultProxy, Recorder]]:
    """An S3Storage with 5 MiB parts reaching the server through a proxy that faults by ``rule``, with
    the test keys, or with ``credentials`` as its options (``{}``: its own credential sources)."""
    faults = Recorder(rule)
    proxy = FaultProxy(s3_server.endpoint, faults)
    options = s3_server.options() if credentials is None else dict(credentials)
    options["endpoint_url"] = proxy.endpoint
    try:
        yield (S3Storage(s3_url, part_bytes=PART, retry=RetryPolicy(first_delay_s=0.01), **options),
               proxy, faults)
    finally:
        proxy.close()


def stored(s3_server, s3_url: str) -> bytes:
    """The test file as the server holds it (read directly, not through the proxy)."""
    return S3Objects(s3_url, **s3_server.options()).read_bytes("shard.bin")


def retry_lines(storage_log) -> list[str]:
    return [r.getMessage() for r in storage_log.records if r.name == "bcp.storage" and "retrying" in r.getMessage()]


def write_through_faults(s3_server, s3_url: str, storage_log, credentials: dict[str, str] | None = None,
                         ) -> tuple[S3Storage, Recorder]:
    """Writes the seven-part test file through the proxy faulting 20% of requests (two part uploads
    at least), with ``credentials`` as in :func:`proxied_storage`, and checks that every retry of the data
    resent one part: the retries logged with the part's byte range, counted, and the bytes sent."""
    rng = random.Random(5)
    first_tries = {2, 5}  # at least two part failures, whatever the dice say

    def rule(method: str, path: str) -> str | None:
        part = part_number(method, path)
        if part in first_tries:
            first_tries.discard(part)
            return "slowdown"
        return rng.choice(["slowdown", "reset", "reset_after"]) if rng.random() < 0.2 else None

    data, views = seven_part_file()
    with proxied_storage(s3_server, s3_url, rule, credentials) as (storage, proxy, faults):
        storage.write_file("shard.bin", views)
    assert stored(s3_server, s3_url) == data

    # every retry of the data went out for one part, with that part's byte range in the log line
    lines = retry_lines(storage_log)
    part_retries = [RANGE.search(line) for line in lines if "writing" in line]
    assert len(part_retries) >= 2 and all(part_retries), lines
    assert {(int(m.group(1)), int(m.group(2))) for m in part_retries} <= part_ranges()
    stats = storage.stats.snapshot()
    assert sum(stats["retries"].values()) == len(lines) and stats["failures"] == {}

    # the bytes sent: the file once plus one part per failed part request, far from a file per failure
    failed_parts = sum(1 for method, path, _ in faults.faulted if part_number(method, path))
    assert failed_parts >= 2
    assert SIZE <= proxy.received_body_bytes <= SIZE + failed_parts * PART + 64 * 1024  # + part lists
    assert 2 * proxy.received_body_bytes < SIZE * (1 + failed_parts)
    return storage, faults
