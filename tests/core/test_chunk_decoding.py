"""Decoding a compressed chunk into the caller's memory: a frame is decoded only where its header
claims exactly the chunk's raw length (nothing larger is allocated first), and the memory each
thread keeps for decoded byte planes never mixes one chunk's bytes into another's."""

from __future__ import annotations

import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bcp.chunk_codecs import ZSTD, ZSTD_EXPONENT_MANTISSA_PLANES, ChunkDecodeError, compress_chunk, decompress_chunk

CHUNK = 1 << 20


def _claiming(frame: memoryview, content_size: int) -> memoryview:
    """``frame`` with the content size its header claims replaced (a 4-byte field: a frame of 64 KiB
    to 4 GiB written without a dictionary)."""
    data = bytearray(frame)
    descriptor = data[4]
    assert descriptor >> 6 == 2 and descriptor & 3 == 0, "expected a 4-byte content size and no dictionary id"
    at = 5 if descriptor & 0x20 else 6  # after the window descriptor, which a single-segment frame has not
    data[at: at + 4] = content_size.to_bytes(4, "little")
    return memoryview(bytes(data))


def test_a_frame_that_claims_more_than_its_chunk_is_refused_before_allocating_that():
    codec, stored = compress_chunk(memoryview(bytes(CHUNK)), ZSTD, 1, 1)
    hostile = _claiming(stored, (4 << 30) - 1)  # 4 GiB
    tracemalloc.start()
    try:
        with pytest.raises(ChunkDecodeError):
            decompress_chunk(hostile, codec, 1, memoryview(bytearray(CHUNK)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def _chunks(count: int) -> list[tuple[bytes, memoryview]]:
    """``count`` fp32 chunks of different lengths and values: (raw bytes, stored bytes)."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for i in range(count):
        values = torch.randn(CHUNK // 4 - 1024 * (i % 5), generator=generator) * 0.02 * (i + 1)
        raw = values.numpy().tobytes()
        codec, stored = compress_chunk(memoryview(raw), ZSTD_EXPONENT_MANTISSA_PLANES, 4, 1)
        assert codec == ZSTD_EXPONENT_MANTISSA_PLANES
        out.append((raw, memoryview(bytes(stored))))
    return out


def test_chunks_of_different_lengths_decode_bitwise_one_after_another_and_on_threads_at_once():
    chunks = _chunks(12)

    def decoded(chunk: tuple[bytes, memoryview]) -> bytes:
        raw, stored = chunk
        out = bytearray(len(raw) + 8)  # bytes past the chunk stay as they were
        decompress_chunk(stored, ZSTD_EXPONENT_MANTISSA_PLANES, 4, memoryview(out)[:len(raw)])
        assert out[len(raw):] == bytes(8)
        return bytes(out[:len(raw)])

    assert [decoded(c) for c in chunks] == [raw for raw, _ in chunks]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(decoded, chunks)) == [raw for raw, _ in chunks]
