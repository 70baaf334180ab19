"""Resharded loads on S3 read the bytes in the buffers the GETs fetched them into (no copy into
scratch memory first), against a real SeaweedFS server: rows saved, columns loaded bitwise; a
flipped byte among them is still detected and named; a truncated object names its tensor; GETs cut
inside a segment (its bytes joined from two GETs) load bitwise and a flipped byte at the cut is
named. And the request shapes behind it: as few GETs as the part size allows, cut where the stored
object's parts end."""

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


@pytest.fixture
def get_spans(monkeypatch) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Per ``read_views`` call of the test: the file offsets where its sizes end, and its GETs."""
    calls: list[tuple[list[int], list[tuple[int, int]]]] = []
    original_views, original_get = S3Objects.read_views, S3Objects._get

    def views(self, name, offset, sizes):
        calls.append((list(itertools.accumulate(sizes, initial=offset)), []))
        return original_views(self, name, offset, sizes)

    def get(self, name, spans):
        if calls:
            calls[-1][1].extend(spans)
        return original_get(self, name, spans)

    monkeypatch.setattr(S3Objects, "read_views", views)
    monkeypatch.setattr(S3Objects, "_get", get)
    return calls


def _cuts_inside_segments(calls) -> list[int]:
    """File offsets where a GET ended inside a segment of its ``read_views`` call."""
    return [end for ends, spans in calls for _, end in spans[:-1] if end not in ends]


def test_gets_cut_inside_segments_load_bitwise_and_a_flipped_byte_at_a_cut_is_named(s3_url, s3_env, get_spans):
    """A column range of a matrix of short rows needs bytes of every checksum chunk, so the reader
    asks for the whole stored tensor in back-to-back 4 MiB segments; with 5 MiB GETs (the smallest
    part S3 allows) most cuts fall inside a segment, whose bytes are then joined from two GETs. The
    columns load bitwise, and a byte flipped right at such a cut is detected and its tensor named."""
    rows, columns, wanted = 4096, 2048, (3, 1500)  # 32 MiB of fp32 rows of 8 KiB
    matrix = torch.randn(rows, columns, generator=torch.Generator().manual_seed(4))
    bcp.save(s3_url, {"model": {"m": matrix}})
    small_gets = S3Storage(s3_url, part_bytes=5 << 20)

    def load() -> torch.Tensor:
        piece = bcp.TensorShard(torch.zeros(rows, wanted[1] - wanted[0]), (rows, columns), (0, wanted[0]))
        bcp.load(small_gets, {"model": {"m": [piece]}})
        return piece.tensor

    loaded = load()
    assert torch.equal(loaded.view(torch.int32), matrix[:, wanted[0]:wanted[1]].contiguous().view(torch.int32))
    cuts = _cuts_inside_segments(get_spans)
    assert cuts, get_spans  # the joined path was taken

    manifest = read_manifest(s3_url)
    stored = manifest.tensors["model/m"].shards[0].bytes
    name = f"gen-{manifest.generation:08d}/{manifest.files[stored.file]}"
    data = bytearray(small_gets.read_bytes(name))
    data[cuts[0]] ^= 0x01
    small_gets.write_file(name, [memoryview(data)])
    with pytest.raises(bcp.CorruptCheckpointError, match=r"checksum mismatch in data/.*'model/m'"):
        load()


@pytest.mark.parametrize(("offset", "nbytes", "spans"), [
    (0, 40, [(0, 16), (16, 32), (32, 40)]),  # requests of the limit from a multiple of it
    (3, 40, [(3, 16), (16, 32), (32, 43)]),  # cut at the file's multiples of the limit, not the read's
    (10, 18, [(10, 16), (16, 28)]),  # two are needed either way: cut where a part ends
    (15, 2, [(15, 17)]),  # one request across a multiple rather than two
    (14, 32, [(14, 32), (32, 46)]),  # the short first piece joined to the next: 2 requests, not 3
    (0, 0, []),
])
def test_requests_are_as_few_as_the_limit_allows_and_cut_where_the_files_parts_end(offset, nbytes, spans):
    assert request_spans(offset, nbytes, 16) == spans


def test_a_run_just_under_four_limits_takes_four_requests_not_five():
    """Requests used to end where the caller's views ended (the last that fit under the limit): a
    62 MiB batch of 3.5 MiB segments of a resharded load took five GETs, the last a short one."""
    mib = 1 << 20
    assert len(request_spans(0, 61 * mib + mib // 2, 16 * mib)) == 4


def test_views_are_slices_of_the_parts_and_a_size_across_parts_is_joined():
    parts = [b"abcdef", bytearray(b"ghij"), memoryview(b"klm")]
    views = cut_views(parts, [2, 4, 5, 2], lambda end: f"ends before {end}")
    assert [bytes(v) for v in views] == [b"ab", b"cdef", b"ghijk", b"lm"]
    assert views[1].obj is parts[0]  # a slice of the fetched buffer, not a copy
    with pytest.raises(EOFError, match="ends before 14"):
        cut_views(parts, [12, 2], lambda end: f"ends before {end}")
