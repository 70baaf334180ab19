"""S3 multipart uploads whose parts are retried one by one, against a real SeaweedFS server: faults
injected by the loopback proxy cost a resend of the failed part, not of the file; a permanent 403 on
a part fails at once and leaves no object; a checkpoint with multi-part data files round-trips."""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import re
import threading
from collections.abc import Iterator
from datetime import datetime, timezone

import bcp
import pytest
import torch
from bcp.storage import RetryPolicy, S3Storage
from bcp.storage.s3 import S3Objects, _warn_whole_uploads
from bcp.storage.sigv4 import Credentials, sign
from s3_fault_proxy import FaultProxy

PART = 5 << 20  # S3's smallest part
SIZE = 6 * PART + 12345  # seven parts, the last one short
RANGE = re.compile(r"/shard\.bin bytes (\d+)-(\d+)")


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
def _proxied_storage(s3_server, s3_url: str, rule) -> Iterator[tuple[S3Storage, FaultProxy, Recorder]]:
    """An S3Storage with 5 MiB parts reaching the server through a proxy that faults by ``rule``."""
    faults = Recorder(rule)
    proxy = FaultProxy(s3_server.endpoint, faults)
    try:
        yield (S3Storage(s3_url, part_bytes=PART, retry=RetryPolicy(first_delay_s=0.01),
                         **s3_server.options(proxy.endpoint)), proxy, faults)
    finally:
        proxy.close()


def _stored(s3_server, s3_url: str) -> bytes:
    """The test file as the server holds it (read directly, not through the proxy)."""
    return S3Objects(s3_url, **s3_server.options()).read_bytes("shard.bin")


def _retry_lines(storage_log) -> list[str]:
    return [r.getMessage() for r in storage_log.records if r.name == "bcp.storage" and "retrying" in r.getMessage()]


def test_faults_on_20_percent_of_requests_resend_only_the_failed_parts(s3_server, s3_url, storage_log):
    rng = random.Random(5)
    first_tries = {"partNumber=2&", "partNumber=5&"}  # at least two part failures, whatever the dice say

    def rule(method: str, path: str) -> str | None:
        forced = next((p for p in first_tries if p in path), None)
        if method == "PUT" and forced:
            first_tries.discard(forced)
            return "slowdown"
        return rng.choice(["slowdown", "reset", "reset_after"]) if rng.random() < 0.2 else None

    data, views = _data()
    with _proxied_storage(s3_server, s3_url, rule) as (storage, proxy, faults):
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
    failed_parts = sum(1 for method, path, _ in faults.faulted if method == "PUT" and "partNumber=" in path)
    assert failed_parts >= 2
    assert SIZE <= proxy.received_body_bytes <= SIZE + failed_parts * PART + 64 * 1024  # + part lists
    assert 2 * proxy.received_body_bytes < SIZE * (1 + failed_parts)


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
    forbid = lambda method, path: "forbidden" if method == "PUT" and "partNumber=3&" in path else None
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
    client = direct._parts_client
    key = f"{s3_url.split('/', 3)[3]}/shard.bin"
    _, _, pending = client.request("GET", "", {"uploads": "", "prefix": key})
    assert b"<UploadId>" not in pending, pending


def test_a_checkpoint_with_multipart_data_files_saves_and_loads_bitwise(s3_server, s3_url):
    model = torch.nn.Linear(2048, 1536)  # 12 MiB of weights: a data file of three 5 MiB parts
    fresh = torch.nn.Linear(2048, 1536)
    with _proxied_storage(s3_server, s3_url, lambda method, path: None) as (storage, _, faults):
        bcp.save(storage, {"model": model})
        bcp.load(storage, {"model": fresh})
    parts = {path.split("partNumber=")[1].split("&")[0] for method, path in faults.seen
             if method == "PUT" and "partNumber=" in path}
    assert parts == {"1", "2", "3"}
    for name, value in model.state_dict().items():
        assert torch.equal(value.view(torch.int32), fresh.state_dict()[name].view(torch.int32)), name


def test_the_signature_matches_the_published_sigv4_examples():
    # AWS's S3 SigV4 documentation signs these two GETs with its example keys at 2013-05-24T00:00:00Z
    keys = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    at = datetime(2013, 5, 24, tzinfo=timezone.utc)
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    host = "examplebucket.s3.amazonaws.com"
    for query, signature in [({"lifecycle": ""}, "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543"),
                             ({"max-keys": "2", "prefix": "J"},
                              "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7")]:
        headers = sign("GET", host, "/", query, keys, "us-east-1", empty, at)
        assert headers["Authorization"].endswith(f"Signature={signature}")


def test_parts_smaller_than_s3_allows_are_refused():
    with pytest.raises(ValueError, match="part_bytes"):
        S3Objects("s3://ckpt/x", endpoint_url="http://127.0.0.1:1", part_bytes=PART - 1)


@pytest.mark.parametrize("setting", [{}, {"AWS_SERVER_SIDE_ENCRYPTION": "aws:kms"}])
def test_without_keys_or_with_settings_it_lacks_the_part_client_says_so_and_leaves_the_upload_to_obstore(
        setting, monkeypatch, caplog):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    keys = {"access_key_id": "a", "secret_access_key": "b"} if setting else {}
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    _warn_whole_uploads.cache_clear()
    caplog.set_level(logging.WARNING, logger="bcp.storage")
    objects = S3Objects("s3://ckpt/x", endpoint_url="http://127.0.0.1:1", part_bytes=PART, **keys)
    assert objects.parted_upload("big", [memoryview(bytes(PART + 1))]) is None
    expected = next(iter(setting), "no access keys")
    assert [r.getMessage() for r in caplog.records if expected in r.getMessage() and "retried whole" in r.getMessage()]
