"""The lossless codecs considered for checkpoints, measured alone on a state's bytes: each tensor cut
into the 1 MiB chunks bcp checksums (and compresses), every chunk compressed and decompressed on one
thread. Per codec: stored bytes (in total and per part of the state; a chunk that does not shrink
counts at its raw length, stored raw as bcp stores it) and the process CPU seconds of compressing and
of decompressing everything, the medians of a few repetitions; and the chunks that did not come back
bit for bit."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from bcp import chunk_codecs

CHUNK = 1 << 20  # bcp's checksum chunk: the unit it compresses
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Codec:
    name: str
    compress: Callable[[bytes, int], Any]  # (chunk, element size) -> what is stored
    decompress: Callable[[Any, int, int], bytes]  # (what is stored, element size, raw length) -> chunk
    size: Callable[[Any], int] = len  # the stored bytes of what ``compress`` returned


def _zstd(level: int, codec: int) -> Codec:
    """bcp's own chunk coder (``bcp.chunk_codecs``) with one of its codecs: zstd over the chunk's
    bytes, over its byte planes (byte b of every element together), or over the byte planes of its
    elements rotated (the exponent, or its low six bits and the mantissa's top two, in the top
    plane); elements of one byte are coded whole. A chunk it does not make smaller it keeps raw."""
    def compress(chunk: bytes, k: int) -> tuple[int, memoryview]:
        return chunk_codecs.compress_chunk(memoryview(chunk), codec if k > 1 else chunk_codecs.ZSTD, k, level)

    def decompress(stored: tuple[int, memoryview], k: int, n: int) -> bytes:
        out = bytearray(n)
        chunk_codecs.decompress_chunk(stored[1], stored[0], k, memoryview(out))
        return bytes(out)

    return Codec(f"zstandard level {level}, {_LAYOUTS[codec]} (bcp's codec {codec})", compress, decompress,
                 lambda stored: stored[1].nbytes)


_LAYOUTS = {chunk_codecs.ZSTD: "whole bytes", chunk_codecs.ZSTD_PLANES: "byte planes",
            chunk_codecs.ZSTD_EXPONENT_PLANES: "exponent planes",
            chunk_codecs.ZSTD_EXPONENT_MANTISSA_PLANES: "exponent and mantissa planes"}


def _blosc2(codec_name: str, level: int, bytedelta: bool) -> Codec:
    """blosc2's shuffle filter is its byte planes (per block); bytedelta then stores each plane's
    differences between neighbouring bytes."""
    import blosc2

    def compress(chunk: bytes, k: int) -> bytes:
        filters, meta = [blosc2.Filter.SHUFFLE], [0]
        if bytedelta:
            filters, meta = filters + [blosc2.Filter.BYTEDELTA], meta + [k]
        return blosc2.compress2(chunk, typesize=k, clevel=level, codec=getattr(blosc2.Codec, codec_name),
                                filters=filters, filters_meta=meta, nthreads=1)

    def decompress(stored: bytes, k: int, n: int) -> bytes:
        return blosc2.decompress2(stored, nthreads=1)

    name = f"blosc2 {codec_name.lower()} level {level}, shuffle{' + bytedelta' if bytedelta else ''}"
    return Codec(name, compress, decompress)


def _zipnn() -> Codec:
    """ZipNN's own choice (byte grouping, then Huffman or zstd per group), one thread. ZipNN 0.5.4
    gives back other bytes than it was given in its ``bfloat16`` and ``float32`` modes (measured
    here, every chunk: bits it reorders are not put back); its ``float16`` mode, the same two byte
    groups without the reordering, gives bf16 bytes back intact and compresses them as well, so bf16
    goes through that mode. fp32 has no such mode: its chunks are shown as not lossless."""
    import zipnn

    coders = {2: zipnn.ZipNN(bytearray_dtype="float16", threads=1),
              4: zipnn.ZipNN(bytearray_dtype="float32", threads=1)}
    return Codec("zipnn (bf16 in its float16 mode)", lambda chunk, k: coders[k].compress(chunk),
                 lambda stored, k, n: bytes(coders[k].decompress(stored)))


def considered() -> list[Codec]:
    """What bcp writes (codec 4 for bf16 and fp32) and the layouts it wrote before, then the other
    libraries; zstd-3 on whole bytes only, since a higher level gained nothing on planes."""
    return [_zstd(1, chunk_codecs.ZSTD), _zstd(3, chunk_codecs.ZSTD), _zstd(1, chunk_codecs.ZSTD_PLANES),
            _zstd(1, chunk_codecs.ZSTD_EXPONENT_PLANES), _zstd(1, chunk_codecs.ZSTD_EXPONENT_MANTISSA_PLANES),
            _blosc2("ZSTD", 1, False), _blosc2("ZSTD", 1, True), _blosc2("LZ4", 5, False),
            _zipnn()]


@dataclass
class Chunk:
    part: str
    itemsize: int
    data: bytes


def chunks(state: Tensors, part_of: Callable[[str], str]) -> list[Chunk]:
    """Every tensor's bytes in ``CHUNK``-byte pieces, with the part of the state it belongs to."""
    out = []
    for name, tensor in state.items():
        raw = tensor.detach().contiguous().view(torch.uint8).flatten().numpy()
        for start in range(0, raw.size, CHUNK):
            out.append(Chunk(part_of(name), tensor.element_size(), raw[start: start + CHUNK].tobytes()))
    return out


def measure(codec: Codec, pieces: list[Chunk], reps: int) -> dict:
    """Per part and in total: raw and stored bytes, and the chunks that did not come back bit for
    bit (a codec that loses data is shown as such, not left out); and the median CPU seconds of
    compressing and of decompressing every chunk."""
    compress_s, decompress_s, stored, back = [], [], [], []
    for _ in range(reps):
        started = time.process_time()
        stored = [codec.compress(c.data, c.itemsize) for c in pieces]
        compress_s.append(time.process_time() - started)
        started = time.process_time()
        back = [codec.decompress(s, c.itemsize, len(c.data)) for s, c in zip(stored, pieces)]
        decompress_s.append(time.process_time() - started)
    by_part: dict[str, list[int]] = {}
    for c, s, b in zip(pieces, stored, back):
        raw_stored_differ = by_part.setdefault(c.part, [0, 0, 0])
        raw_stored_differ[0] += len(c.data)
        raw_stored_differ[1] += min(codec.size(s), len(c.data))
        raw_stored_differ[2] += b != c.data
    totals = [sum(v[i] for v in by_part.values()) for i in range(3)]
    return {"by_part": by_part, "raw": totals[0], "stored": totals[1], "differ": totals[2],
            "compress_cpu_s": statistics.median(compress_s), "decompress_cpu_s": statistics.median(decompress_s)}
