"""Large files reach S3 part by part while the writer still produces them, against a real SeaweedFS
behind the fault proxy: a compressed file's first part is sent before its last chunk is compressed
(and a faulted part is sent again alone), the stream is drawn no further ahead of the sends than the
parts in flight allow, and a save whose upload fails or whose stream stops leaves no object behind
(the previous generation still loads)."""

from __future__ import annotations

import threading

import bcp
import pytest
import torch
from bcp.engine import chunk_coding
from bcp.errors import SaveAbandonedError
from bcp.storage import S3Storage
from bcp.storage.s3 import S3Objects
from s3_fault_proxy import FaultProxy
from s3_part_uploads import PART, part_number, proxied_storage, retry_lines

MIB = 1 << 20
ROWS, COLUMNS = 6144, 1024  # 24 MiB of fp32 weights: 24 chunks, about 4 compressed parts of 5 MiB


def _weights(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(seed)) * 0.02


def _parts_sent(faults) -> list[int]:
    with faults.lock:
        return [n for n in (part_number(method, path) for method, path in faults.seen) if n]


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    """Whether ``condition()`` came true within ``timeout_s`` (polled)."""
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return condition()


def _pending_uploads(s3_server, s3_url: str) -> list:
    direct = S3Objects(s3_url, **s3_server.options())
    prefix = s3_url.split("/", 3)[3]
    return direct.connection.call("list_multipart_uploads", "listing uploads", Prefix=prefix).get("Uploads", [])


def test_a_compressed_file_sends_its_first_part_before_its_last_chunk_is_compressed(s3_server, s3_url,
                                                                                    storage_log, monkeypatch):
    """The hook on the codec (the real one, called through) holds the file's last chunk until the
    proxy has received a whole first part: a save that compressed the file before uploading it would
    wait there in vain and fail the test. Part 2's first try is answered 503 SlowDown."""
    weights = _weights(1)
    chunks = weights.nbytes // MIB
    compressed, first_part_before_last_chunk = [0], []
    compress = chunk_coding.compress_chunk

    def hooked(*args, **kwargs):
        compressed[0] += 1
        if compressed[0] == chunks:
            first_part_before_last_chunk.append(_wait_for(lambda: 1 in _parts_sent(faults)))
        return compress(*args, **kwargs)

    monkeypatch.setattr(chunk_coding, "compress_chunk", hooked)
    slowed = set()

    def slow_part_2(method, path):
        if part_number(method, path) == 2 and not slowed:
            slowed.add(2)
            return "slowdown"
        return None

    with proxied_storage(s3_server, s3_url, slow_part_2) as (storage, _, faults):
        bcp.save(storage, {"model": {"w": weights}}, compression="zstd", io_threads=1)
        loaded = {"w": torch.zeros_like(weights)}
        bcp.load(storage, {"model": loaded})
    assert first_part_before_last_chunk == [True]
    assert torch.equal(loaded["w"].view(torch.int32), weights.view(torch.int32))
    sent = _parts_sent(faults)
    assert max(sent) >= 3 and sorted(sent) == [1, 2, *range(2, max(sent) + 1)], sent  # part 2 twice, the rest once
    lines = retry_lines(storage_log)
    assert len(lines) == 1 and f"bytes {PART}-{2 * PART - 1}" in lines[0], lines
    assert storage.stats.snapshot() == {"retries": {"SlowDown": 1}, "failures": {}}


def test_the_stream_is_drawn_only_as_far_as_the_parts_in_flight_allow(s3_server, s3_url):
    """Two request slots, every part held at the proxy: with two parts in flight the writer cuts a
    third (one byte past it drawn, to know it is not the last) and waits for a send to end, instead
    of drawing the whole file."""
    release, drawn, arrived = threading.Event(), [0], []
    views = [memoryview(bytes([i]) * MIB) for i in range(12 * PART // MIB)]  # twelve parts of 1 MiB views

    def held(method, path):
        if part_number(method, path):
            arrived.append(part_number(method, path))
            release.wait(10)
        return None

    def stream():
        for view in views:
            drawn[0] += 1
            yield view

    proxy = FaultProxy(s3_server.endpoint, held)  # not the recording one: its lock would queue the parts
    storage = S3Storage(s3_url, part_bytes=PART, max_requests=2, **s3_server.options(proxy.endpoint))
    writer = threading.Thread(target=storage.write_file, args=("shard.bin", stream()))
    writer.start()
    try:
        assert _wait_for(lambda: len(arrived) == 2)
        threading.Event().wait(0.3)  # time for a writer that does not wait to draw on
        assert drawn[0] <= 3 * PART // MIB + 1, drawn[0]
    finally:
        release.set()
        writer.join()
        proxy.close()
    assert S3Objects(s3_url, **s3_server.options()).read_bytes("shard.bin") == b"".join(views)


def test_a_stream_that_stops_midway_aborts_its_upload_and_leaves_no_object(s3_server, s3_url):
    """What a save abandoned while its file is being written does to the upload (the writer's
    stream raises SaveAbandonedError): parts already sent are dropped with the upload."""

    def stream():
        for index in range(3 * PART // MIB):
            yield memoryview(bytes([index]) * MIB)
        assert _wait_for(lambda: 1 in _parts_sent(faults))
        raise SaveAbandonedError("the save was abandoned")

    with (proxied_storage(s3_server, s3_url, lambda method, path: None) as (storage, _, faults),
          pytest.raises(SaveAbandonedError)):
        storage.write_file("shard.bin", stream())
    assert ("DELETE" in {method for method, _ in faults.seen})
    assert not S3Objects(s3_url, **s3_server.options()).exists("shard.bin")
    assert not _pending_uploads(s3_server, s3_url)


def test_a_save_whose_part_is_refused_leaves_no_object_and_the_previous_generation_loads(s3_server, s3_url):
    first, second = _weights(2), _weights(3)
    refuse = threading.Event()
    rule = lambda method, path: "forbidden" if refuse.is_set() and part_number(method, path) == 2 else None
    with proxied_storage(s3_server, s3_url, rule) as (storage, _, _):
        bcp.save(storage, {"model": {"w": first}}, compression="zstd")
        listed = set(S3Objects(s3_url, **s3_server.options()).list_dir(""))
        refuse.set()
        with pytest.raises(bcp.StorageError, match="AccessDenied"):
            bcp.save(storage, {"model": {"w": second}}, compression="zstd")
        refuse.clear()
        assert set(S3Objects(s3_url, **s3_server.options()).list_dir("")) == listed
        assert not _pending_uploads(s3_server, s3_url)
        loaded = {"w": torch.zeros_like(first)}
        bcp.load(storage, {"model": loaded})
    assert torch.equal(loaded["w"].view(torch.int32), first.view(torch.int32))
