"""S3 multipart uploads whose parts are retried one by one, against a real SeaweedFS server: faults
injected by the loopback proxy cost a resend of the failed part, not of the file; a permanent 403 on
a part fails at once and leaves no object; a checkpoint with multi-part data files round-trips."""

from __future__ import annotations

import contextlib
import itertools
import random
import re
import threading
from collections.abc import Iterator

import bcp
import pytest
import torch
from bcp.storage import RetryPolicy, S3Storage
from bcp.storage.s3 import S3Objects
from s3_fault_proxy import FaultProxy

PART = 5 << 20  # S3's smallest part
SIZE = 6 * PART + 12345  # seven parts, the last one short
RANGE = re.compile(r"/shard\.bin bytes (\d+)-(\d+)")
PART_NUMBER = re.compile(r"[?&]partNumber=(\d+)")


def _part_number(method: str, path: str) -> int | None:
    """The part an UploadPart request sends; None for any other request."""
    found = PART_NUMBER.search(path) if method == "PUT" else None
    return int(found.group(1)) if found else None


def _data() -> tuple[bytes, list[memoryview]]:
    """SIZE random bytes, as buffers of odd sizes so that parts span buffer boundaries."""
    data = random.Random(3).randbytes(SIZE)
    cuts = [0, 1, 7 << 20, 7 << 20, (19 << 20) + 3, SIZE]  # an empty buffer and a one-byte one included
    return data, [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]


def _part_ranges() -> set[tuple[int, int]]:
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
def _proxied_storage(s3_server, s3_url: str, rule, credentials: dict[str, str] | None = None,
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


def _stored(s3_server, s3_url: str) -> bytes:
    """The test file as the server holds it (read directly, not through the proxy)."""
    return S3Objects(s3_url, **s3_server.options()).read_bytes("shard.bin")


def _retry_lines(storage_log) -> list[str]:
    return [r.getMessage() for r in storage_log.records if r.name == "bcp.storage" and "retrying" in r.getMessage()]


def write_through_faults(s3_server, s3_url: str, storage_log, credentials: dict[str, str] | None = None,
                         ) -> tuple[S3Storage, Recorder]:
    """Writes the seven-part test file through the proxy faulting 20% of requests (two part uploads
    at least), with ``credentials`` as in :func:`_proxied_storage`, and checks that every retry of the data
    resent one part: the retries logged with the part's byte range, counted, and the bytes sent."""
    rng = random.Random(5)
    first_tries = {2, 5}  # at least two part failures, whatever the dice say

    def rule(method: str, path: str) -> str | None:
        part = _part_number(method, path)
        if part in first_tries:
            first_tries.discard(part)
            return "slowdown"
        return rng.choice(["slowdown", "reset", "reset_after"]) if rng.random() < 0.2 else None

    data, views = _data()
    with _proxied_storage(s3_server, s3_url, rule, credentials) as (storage, proxy, faults):
        storage.write_file("shard.bin", views)
    assert _stored(s3_server, s3_url) == data

    # every retry of the data went out for one part, with that part's byte range in the log line
    lines = _retry_lines(storage_log)
    part_retries = [RANGE.search(line) for line in lines if "writing" in line]
    assert len(part_retries) >= 2 and all(part_retries), lines
    assert {(int(m.group(1)), int(m.group(2))) for m in part_retries} <= _part_ranges()
    stats = storage.stats.snapshot()
    assert sum(stats["retries"].values()) == len(lines) and stats["failures"] == {}

    # the bytes sent: the file once plus one part per failed part request, far from a file per failure
    failed_parts = sum(1 for method, path, _ in faults.faulted if _part_number(method, path))
    assert failed_parts >= 2
    assert SIZE <= proxy.received_body_bytes <= SIZE + failed_parts * PART + 64 * 1024  # + part lists
    assert 2 * proxy.received_body_bytes < SIZE * (1 + failed_parts)
    return storage, faults


def test_faults_on_20_percent_of_requests_resend_only_the_failed_parts(s3_server, s3_url, storage_log):
    write_through_faults(s3_server, s3_url, storage_log)


@pytest.mark.parametrize("answers", [["reset_after"], ["reset_after", "no_such_upload"]])
def test_a_completion_whose_reply_is_lost_is_not_mistaken_for_a_failure(s3_server, s3_url, storage_log, answers):
    """The server completes the upload, the reply is lost; the retry finds it completed (SeaweedFS) or
    is told the upload is gone (S3) and finds the whole object there."""
    data, views = _data()
    with _proxied_storage(s3_server, s3_url, _completions(answers)) as (storage, proxy, _):
        storage.write_file("shard.bin", views)
    assert proxy.faults == dict.fromkeys(answers, 1)
    assert storage.stats.snapshot() == {"retries": {"no reply": 1}, "failures": {}}
    assert any("completing the upload of" in line for line in _retry_lines(storage_log))
    assert _stored(s3_server, s3_url) == data


def test_a_completion_that_never_reached_the_server_is_not_taken_for_done(s3_server, s3_url):
    _, views = _data()
    with (_proxied_storage(s3_server, s3_url, _completions(["reset", "no_such_upload"])) as (storage, _, _),
          pytest.raises(bcp.StorageError, match="NoSuchUpload")):
        storage.write_file("shard.bin", views)
    assert not S3Objects(s3_url, **s3_server.options()).exists("shard.bin")


def _completions(answers: list[str]):
    """A fault rule answering the successive CompleteMultipartUpload requests with ``answers``."""
    pending = iter(answers)
    return lambda method, path: next(pending, None) if method == "POST" and "uploadId=" in path else None


def test_a_permanent_403_on_a_part_fails_at_once_and_leaves_no_object(s3_server, s3_url, storage_log):
    _, views = _data()
    forbid = lambda method, path: "forbidden" if _part_number(method, path) == 3 else None
    with (_proxied_storage(s3_server, s3_url, forbid) as (storage, _, faults),
          pytest.raises(bcp.CheckpointError, match="403") as failure):
        storage.write_file("shard.bin", views)
    message = str(failure.value)
    assert isinstance(failure.value, bcp.StorageError)
    assert f"{s3_url}/shard.bin bytes {2 * PART}-{3 * PART - 1}" in message, message
    assert "attempt 1 (permanent error)" in message and "AccessDenied" in message
    assert len(faults.faulted) == 1 and not _retry_lines(storage_log)
    assert storage.stats.snapshot() == {"retries": {}, "failures": {"AccessDenied": 1}}
    # aborted, not completed: no object, and no upload left pending under the name
    direct = S3Objects(s3_url, **s3_server.options())
    assert ("DELETE" in {method for method, _ in faults.seen}) and not direct.exists("shard.bin")
    key = f"{s3_url.split('/', 3)[3]}/shard.bin"
    pending = direct.connection.call("list_multipart_uploads", "listing uploads", Prefix=key)
    assert not pending.get("Uploads"), pending


def test_a_checkpoint_with_multipart_data_files_saves_and_loads_bitwise(s3_server, s3_url):
    model = torch.nn.Linear(2048, 1536)  # 12 MiB of weights: a data file of three 5 MiB parts
    fresh = torch.nn.Linear(2048, 1536)
    with _proxied_storage(s3_server, s3_url, lambda method, path: None) as (storage, _, faults):
        bcp.save(storage, {"model": model})
        bcp.load(storage, {"model": fresh})
    parts = {_part_number(method, path) for method, path in faults.seen} - {None}
    assert parts == {1, 2, 3}
    for name, value in model.state_dict().items():
        assert torch.equal(value.view(torch.int32), fresh.state_dict()[name].view(torch.int32)), name


def test_parts_smaller_than_s3_allows_are_refused():
    with pytest.raises(ValueError, match="part_bytes"):
        S3Objects("s3://ckpt/x", endpoint_url="http://127.0.0.1:1", part_bytes=PART - 1)
