"""Compressed checkpoints (format version 4): the chunk codec, the shard table's columns of stored
chunks and their validation, saves and loads that compress, and reads that decode only the chunks
they need."""

from __future__ import annotations

import struct

import crc32c
import numpy as np
import pytest
import torch

from bcp.chunk_codecs import (RAW, ZSTD, ZSTD_PLANES, ChunkDecodeError, Compression, compress_chunk, decompress_chunk,
                              join_planes, split_planes)
from bcp.errors import CorruptCheckpointError
from bcp.layout.box import Box
from bcp.layout.dtypes import plane_width
from bcp.layout.manifest import Manifest, TensorEntry
from bcp.layout.shard_table import ByteRange, ShardEntry, StoredChunks

CHUNK = 1 << 20


def _trained_like(dtype: torch.dtype, n: int) -> torch.Tensor:
    """Values spread like trained weights (normal, small), in ``dtype``."""
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(n, generator=generator) * 0.02).to(dtype)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()) if tensor.dtype != torch.bool \
        else memoryview(tensor.numpy().view(np.uint8))


@pytest.mark.parametrize("width", [2, 4, 8])
def test_byte_planes_split_and_join_back_bitwise(width):
    raw = np.random.default_rng(width).integers(0, 256, 4096 * width, dtype=np.uint8)
    planes = split_planes(memoryview(raw), width)
    assert planes.shape == (width, 4096)
    assert np.array_equal(planes[0], raw[0::width]) and np.array_equal(planes[width - 1], raw[width - 1::width])
    out = np.empty_like(raw)
    join_planes(memoryview(planes.reshape(-1)), width, memoryview(out))
    assert np.array_equal(out, raw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64])
def test_a_floating_point_chunk_is_coded_in_byte_planes_smaller_and_decodes_bitwise(dtype):
    raw = _bytes_of(_trained_like(dtype, CHUNK // torch.empty((), dtype=dtype).element_size()))
    width = plane_width(dtype)
    codec, stored = compress_chunk(raw, ZSTD_PLANES, width, 1)
    assert codec == ZSTD_PLANES and stored.nbytes < raw.nbytes
    out = bytearray(raw.nbytes)
    decompress_chunk(stored, codec, width, memoryview(out))
    assert bytes(out) == raw.tobytes()


def test_byte_planes_beat_whole_bytes_on_bf16_weights():
    raw = _bytes_of(_trained_like(torch.bfloat16, CHUNK // 2))
    _, planes = compress_chunk(raw, ZSTD_PLANES, 2, 1)
    _, whole = compress_chunk(raw, ZSTD, 1, 1)
    assert raw.nbytes / planes.nbytes > 1.3 > raw.nbytes / whole.nbytes


def test_incompressible_bytes_are_stored_raw():
    raw = memoryview(np.random.default_rng(1).integers(0, 256, CHUNK, dtype=np.uint8))
    codec, stored = compress_chunk(raw, ZSTD, 1, 1)
    assert codec == RAW and stored.tobytes() == raw.tobytes()


def test_a_chunk_that_is_not_whole_elements_falls_back_to_whole_bytes():
    raw = memoryview(bytes(1001))
    codec, stored = compress_chunk(raw, ZSTD_PLANES, 2, 1)
    assert codec == ZSTD
    out = bytearray(1001)
    decompress_chunk(stored, codec, 2, memoryview(out))
    assert out == bytes(1001)


def test_decoding_makes_exactly_the_raw_length_or_fails():
    raw = memoryview(bytes(CHUNK))  # zeros: a frame of a few bytes that claims 1 MiB
    codec, stored = compress_chunk(raw, ZSTD, 1, 1)
    assert stored.nbytes < 100
    with pytest.raises(ChunkDecodeError):  # a hostile raw length smaller than the frame's content
        decompress_chunk(stored, codec, 1, memoryview(bytearray(4096)))
    with pytest.raises(ChunkDecodeError):  # a frame that makes fewer bytes than the chunk holds
        decompress_chunk(stored, codec, 1, memoryview(bytearray(CHUNK + 1)))
    with pytest.raises(ChunkDecodeError):  # a truncated frame
        decompress_chunk(stored[:-3], codec, 1, memoryview(bytearray(CHUNK)))
    with pytest.raises(ChunkDecodeError):  # garbage
        decompress_chunk(memoryview(b"\x00" * 64), codec, 1, memoryview(bytearray(CHUNK)))
    with pytest.raises(ChunkDecodeError):
        decompress_chunk(stored, 9, 1, memoryview(bytearray(CHUNK)))


def test_compression_options_are_checked():
    assert Compression.of("zstd") == Compression("zstd", 1)
    assert Compression.of(True) == Compression() and Compression.of(None) is None and Compression.of(False) is None
    assert Compression.of(Compression(level=3)).level == 3
    with pytest.raises(ValueError, match="unknown compression codec 'lz5'"):
        Compression.of("lz5")
    with pytest.raises(ValueError, match="level"):
        Compression(level=0)
    with pytest.raises(ValueError, match="compression must be"):
        Compression.of(3)


def test_plane_widths_of_dtypes():
    assert [plane_width(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64,
                                     torch.complex128, torch.int32, torch.uint8, torch.bool)] == [2, 2, 4, 8, 4, 8, 1, 1, 1]


def _manifest_with(stored: StoredChunks | None, nbytes: int = 40, chunk: int = 16):
    crcs = tuple(range(1, -(-nbytes // chunk) + 1))
    shard = ShardEntry(Box((0,), (nbytes // 4,)), ByteRange(0, 0, nbytes, crcs, stored))
    return Manifest(generation=1, world_size=1, framework="plain", files=["data/00000-00.bin"],
                    tensors={"model/w": TensorEntry("model/w", "float32", (nbytes // 4,), [shard])}, objects={},
                    checksum_chunk=chunk, version=4, compression=Compression())


def test_a_version_4_shard_table_round_trips_its_stored_chunks():
    stored = StoredChunks((ZSTD_PLANES, RAW, ZSTD), (5, 16, 3), (7, 2, 9))
    doc, table = _manifest_with(stored).encode()
    back = Manifest.decode(doc, table)
    assert back.version == 4 and back.compression == Compression()
    where = back.tensors["model/w"].shards[0].bytes
    assert where.stored == stored and where.stored_nbytes == 24 and where.nbytes == 40 and where.crcs == (1, 2, 3)
    doc, table = _manifest_with(None).encode()  # every chunk raw: read as before version 4
    assert Manifest.decode(doc, table).tensors["model/w"].shards[0].bytes.stored is None


@pytest.mark.parametrize("stored, problem", [
    ((9, RAW, RAW), "codec id 9"),
    ((ZSTD, RAW, RAW), None),
])
def test_unknown_codec_ids_are_refused(stored, problem):
    chunks = StoredChunks(stored, (5, 16, 8), (7, 2, 3))
    doc, table = _manifest_with(chunks).encode()
    if problem is None:
        Manifest.decode(doc, table)
        return
    with pytest.raises(CorruptCheckpointError, match=problem):
        Manifest.decode(doc, table)


@pytest.mark.parametrize("lengths, crcs, problem", [
    ((16, 16, 8), (7, 2, 3), "compressed chunk's stored length"),      # not shorter than its raw 16 bytes
    ((0, 16, 8), (7, 2, 3), "compressed chunk's stored length"),       # empty
    ((5, 15, 8), (7, 2, 3), "raw chunk's stored length or checksum"),  # a raw chunk that is not its raw length
    ((5, 16, 8), (7, 5, 3), "raw chunk's stored length or checksum"),  # a raw chunk whose stored crc differs
])
def test_hostile_stored_chunk_lengths_are_refused_before_any_read(lengths, crcs, problem):
    doc, table = _manifest_with(StoredChunks((ZSTD, RAW, RAW), lengths, crcs)).encode()
    with pytest.raises(CorruptCheckpointError, match=problem):
        Manifest.decode(doc, table)


def test_a_stored_length_that_is_not_the_sum_of_its_chunks_is_refused():
    manifest = _manifest_with(StoredChunks((ZSTD, RAW, RAW), (5, 16, 8), (7, 2, 3)))
    doc, table = manifest.encode()
    at = table.index(struct.pack("<q", 29))  # stored_nbytes follows the crcs
    hostile = table[:at] + struct.pack("<q", 1 << 40) + table[at + 8:]
    doc = doc.replace(b'"crc32c":%d' % crc32c.crc32c(table), b'"crc32c":%d' % crc32c.crc32c(hostile))
    with pytest.raises(CorruptCheckpointError, match="not the sum of its chunks"):
        Manifest.decode(doc, hostile)
