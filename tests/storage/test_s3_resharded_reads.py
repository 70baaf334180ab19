"""Resharded loads on S3 read the bytes in the buffers the GETs fetched them into (no copy into
scratch memory first), against a real SeaweedFS server: rows saved, columns loaded bitwise; a
flipped byte among them is still detected and named; a truncated object names its tensor. And the
request shapes behind it: GETs of at most a part that end where the reader's segments end."""

from __future__ import annotations

import itertools

import bcp
import pytest
import torch
from bcp.layout.manifest import ByteRange
from bcp.storage import S3Storage
from bcp.storage.range_reads import cut_views, request_spans
from bcp.storage.s3 import S3Objects
from models import read_manifest

ROWS, COLUMNS = 4, 1_500_000  # fp32 rows of ~5.7 MiB: a column load reads each row in several parts
CUTS = [0, 1, 700_001, 1_499_998, COLUMNS]  # column ranges that end mid-chunk, one of a single column


def _saved(url: str) -> torch.Tensor:
    tensor = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(3))
    bcp.save(url, {"model": {"w": tensor}})
    return tensor


def _column_pieces() -> list[bcp.TensorShard]:
    return [bcp.TensorShard(torch.zeros(ROWS, end - start), (ROWS, COLUMNS), (0, start))
            for start, end in itertools.pairwise(CUTS)]


@pytest.fixture
def view_reads(monkeypatch) -> list[int]:
    """The sizes asked of ``S3Objects.read_views`` during the test, one entry per call."""
    calls: list[int] = []
    original = S3Objects.read_views

    def counted(self, name, offset, sizes):
        calls.append(sum(sizes))
        return original(self, name, offset, sizes)

    monkeypatch.setattr(S3Objects, "read_views", counted)
    return calls


def test_rows_saved_columns_loaded_bitwise_from_the_fetched_buffers(s3_url, s3_env, view_reads):
    tensor = _saved(s3_url)
    pieces = _column_pieces()
    result = bcp.load(s3_url, {"model": {"w": pieces}})
    for piece, (start, end) in zip(pieces, itertools.pairwise(CUTS)):
        assert torch.equal(piece.tensor.view(torch.int32), tensor[:, start:end].contiguous().view(torch.int32))
    assert view_reads and sum(view_reads) == result.stats.bytes  # every byte read went this way


def _saved_data_file(url: str) -> tuple[S3Storage, str, ByteRange, bytearray]:
    """Saves the matrix; the storage, name, the tensor's stored range and the bytes of its data file."""
    _saved(url)
    manifest = read_manifest(url)
    stored = manifest.tensors["model/w"].shards[0].bytes
    storage = S3Storage(url)
    name = f"gen-{manifest.generation:08d}/{manifest.files[stored.file]}"
    return storage, name, stored, bytearray(storage.read_bytes(name))


def test_a_flipped_byte_read_through_the_fetched_buffers_is_detected_and_named(s3_url, s3_env, view_reads):
    storage, name, stored, data = _saved_data_file(s3_url)
    data[stored.offset + (2 * COLUMNS + 900_000) * 4] ^= 0x10  # row 2, a column of the third piece
    storage.write_file(name, [memoryview(data)])
    with pytest.raises(bcp.CorruptCheckpointError, match=r"checksum mismatch in data/.*'model/w'"):
        bcp.load(s3_url, {"model": {"w": _column_pieces()}})
    assert view_reads


def test_a_truncated_object_read_through_the_fetched_buffers_names_its_tensor(s3_url, s3_env, view_reads):
    storage, name, stored, data = _saved_data_file(s3_url)
    storage.write_file(name, [memoryview(data)[:stored.offset + stored.nbytes // 2]])
    with pytest.raises(bcp.CorruptCheckpointError, match=r"truncated.*'model/w'"):
        bcp.load(s3_url, {"model": {"w": _column_pieces()}})
    assert view_reads


@pytest.mark.parametrize(("offset", "sizes", "spans"), [
    (0, [40], [(0, 16), (16, 32), (32, 40)]),  # one large range: requests of the limit
    (0, [4, 4, 4, 4, 4, 3], [(0, 16), (16, 23)]),  # small ones packed, never cut
    (10, [6, 7, 5], [(10, 23), (23, 28)]),  # a size that would cross the limit starts the next request
    (10, [20, 5], [(10, 26), (26, 35)]),  # the rest of a large size packed with the next
    (0, [5, 0, 5], [(0, 10)]),
    (0, [0], []),
])
def test_requests_end_where_sizes_end_and_hold_at_most_the_limit(offset, sizes, spans):
    assert request_spans(offset, sizes, 16) == spans


def test_views_are_slices_of_the_parts_and_a_size_across_parts_is_joined():
    parts = [b"abcdef", bytearray(b"ghij"), memoryview(b"klm")]
    views = cut_views(parts, [2, 4, 5, 2], lambda end: f"ends before {end}")
    assert [bytes(v) for v in views] == [b"ab", b"cdef", b"ghijk", b"lm"]
    assert views[1].obj is parts[0]  # a slice of the fetched buffer, not a copy
    with pytest.raises(EOFError, match="ends before 14"):
        cut_views(parts, [12, 2], lambda end: f"ends before {end}")
