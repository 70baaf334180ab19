"""How a compressed checkpoint stores each checksum chunk (format version 4): the codec ids of the
format, the user's choice of compression, and the coding of one chunk: zstd over the chunk's bytes,
or over its byte planes for floating-point data (exponent bytes apart from low mantissa bytes); a
chunk the codec does not make smaller is stored raw. Decoding writes exactly the chunk's raw length
into memory the caller holds: a stream that claims more, or is damaged, fails with
``ChunkDecodeError`` before anything larger is allocated.

zstandard releases the interpreter lock while it codes, so writer and reader threads code chunks
in parallel. Every layer uses this module (the manifest's reader validates codec ids, the writer
process codes chunks), so it imports no torch and nothing else of bcp.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import zstandard

#: Stored as it is (also every chunk that a codec did not make smaller).
RAW = 0
#: zstd over the chunk's bytes as they are.
ZSTD = 1
#: zstd over the chunk's byte planes: for elements of ``width`` bytes (a floating-point dtype's, a
#: complex dtype's real part's), byte b of every element together, b = 0 .. width-1.
ZSTD_PLANES = 2
#: zstd over the byte planes of the chunk's elements each rotated left by one bit (the sign moves to
#: bit 0): for bfloat16 and float32 the top plane is then the whole 8-bit exponent, which codes
#: better than sign + 7 exponent bits beside a plane holding the eighth (docs/format.md).
ZSTD_EXPONENT_PLANES = 3
#: As ``ZSTD_EXPONENT_PLANES`` with each element rotated left by three bits: for bfloat16 and float32
#: the top plane holds the exponent's low six bits and the mantissa's top two, the bottom plane ends
#: with the sign and the exponent's top two bits (all but constant in weights and optimizer moments).
#: zstd then codes the mantissa's top bits with the exponent they depend on, and both planes as
#: Huffman-coded literals instead of chance matches (docs/format.md): bf16 weights 1.48x -> 1.55x.
ZSTD_EXPONENT_MANTISSA_PLANES = 4
#: Every codec id a reader of format version 4 knows.
KNOWN = (RAW, ZSTD, ZSTD_PLANES, ZSTD_EXPONENT_PLANES, ZSTD_EXPONENT_MANTISSA_PLANES)
#: The names ``Compression.codec`` accepts.
CODECS = ("zstd",)


@dataclass(frozen=True, slots=True)
class Compression:
    """Lossless compression of a save's tensor bytes, chunk by checksum chunk: ``codec`` (``"zstd"``)
    at ``level``; floating-point data is coded in byte planes. A chunk the codec does not make
    smaller is stored raw. Level 1 gave the best ratio at storage speed (docs/format.md)."""

    codec: str = "zstd"
    level: int = 1

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"unknown compression codec {self.codec!r} (known: {', '.join(CODECS)})")
        if type(self.level) is not int or not 1 <= self.level <= 22:
            raise ValueError(f"the zstd compression level must be an integer in [1, 22], not {self.level!r}")

    @staticmethod
    def of(value: "Compression | str | bool | None") -> "Compression | None":
        """The compression a save asked for: a ``Compression``, a codec name, ``True`` (zstd at
        level 1), or ``None``/``False`` (none); ``ValueError`` for anything else."""
        if value is None or value is False:
            return None
        if value is True:
            return Compression()
        if isinstance(value, str):
            return Compression(value)
        if isinstance(value, Compression):
            return value
        raise ValueError(f"compression must be a codec name ({', '.join(CODECS)}), a bcp.Compression, True or "
                         f"None, not {value!r}")

    def to_manifest(self) -> dict[str, object]:
        return {"codec": self.codec, "level": self.level}


def codec_for(width: int, exponent_bits: int = 0) -> int:
    """The codec id of a chunk of elements whose real parts are ``width`` bytes of floating-point
    data (1: not floating-point) with ``exponent_bits`` bits of exponent."""
    if width == 1:
        return ZSTD
    return ZSTD_EXPONENT_MANTISSA_PLANES if exponent_bits == 8 else ZSTD_PLANES


# One compressor, decompressor and buffer for decoded planes per thread and level (a zstd context is
# not shared between threads; making one per chunk cost more than coding a small chunk).
_contexts = threading.local()
_UNSIGNED = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
#: The bits each element is rotated left by before its planes are split, per codec that rotates.
_ROTATION = {ZSTD_EXPONENT_PLANES: 1, ZSTD_EXPONENT_MANTISSA_PLANES: 3}
_PLANAR = (ZSTD_PLANES, *_ROTATION)


class ChunkDecodeError(ValueError):
    """A stored chunk does not decode to its raw length (damaged, or not what its codec wrote)."""


def compress_chunk(raw: memoryview, codec: int, width: int, level: int) -> tuple[int, memoryview]:
    """``(codec id, stored bytes)`` of one chunk: coded with ``codec`` (``ZSTD_PLANES`` and the
    rotating codecs: in planes of ``width`` bytes), or ``(RAW, raw)`` where that is not smaller."""
    if codec == RAW or raw.nbytes == 0:
        return RAW, raw
    if codec in _PLANAR and (width not in _UNSIGNED or raw.nbytes % width):
        codec = ZSTD  # not whole elements of a width that has planes (a checksum chunk of odd size)
    if codec in _ROTATION:
        rotated = _rotate_left(np.frombuffer(raw, dtype=_UNSIGNED[width]), _ROTATION[codec])
        data = split_planes(memoryview(rotated), width)
    else:
        data = split_planes(raw, width) if codec == ZSTD_PLANES else raw
    stored = _compressor(level).compress(data)
    if len(stored) >= raw.nbytes:
        return RAW, raw
    return codec, memoryview(stored)


def decompress_chunk(stored: memoryview, codec: int, width: int, out: memoryview) -> None:
    """Decode one stored chunk into ``out``, which it must fill exactly."""
    if codec == RAW:
        if stored.nbytes != out.nbytes:
            raise ChunkDecodeError(f"a raw chunk of {stored.nbytes} bytes where {out.nbytes} are expected")
        out[:] = stored
        return
    if codec not in (ZSTD, *_PLANAR):
        raise ChunkDecodeError(f"unknown codec id {codec}")
    if codec in _PLANAR and (width not in _UNSIGNED or out.nbytes % width):
        raise ChunkDecodeError(f"byte planes of width {width} cannot make {out.nbytes} bytes")
    if codec == ZSTD:
        _decompress_into(stored, out)
        return
    planes = _planes_buffer(out.nbytes)
    _decompress_into(stored, planes)
    join_planes(planes, width, out)
    if codec in _ROTATION:  # the planes are joined: their buffer holds the rotation's carried bits
        _rotate_right_in_place(np.frombuffer(out, dtype=_UNSIGNED[width]), _ROTATION[codec],
                               np.frombuffer(planes, dtype=_UNSIGNED[width]))


def _decompress_into(stored: memoryview, out: memoryview) -> None:
    """Decode one zstd frame straight into ``out``: the frame must say it holds exactly
    ``out.nbytes`` bytes, checked before decoding, so a damaged or hostile header cannot make this
    allocate what it claims (zstd then decodes in one pass into ``out``, with no window buffer of its
    own). Into memory the caller holds, since a fresh buffer per chunk (and the copy out of it) cost
    the decode of a compressed load a pass over memory and page faults for every chunk."""
    try:
        claimed = zstandard.frame_content_size(stored)
        if claimed != out.nbytes:
            raise ChunkDecodeError(f"the frame holds {'an unknown number of' if claimed < 0 else claimed} "
                                   f"bytes, {out.nbytes} expected")
        with _decompressor().stream_reader(stored, read_across_frames=False) as reader:
            filled = 0
            while filled < out.nbytes and (got := reader.readinto(out[filled:])):
                filled += got
    except zstandard.ZstdError as exc:
        raise ChunkDecodeError(f"zstd: {exc}") from None
    if filled != out.nbytes:
        raise ChunkDecodeError(f"decoded to {filled} bytes, {out.nbytes} expected")


def _planes_buffer(nbytes: int) -> memoryview:
    """This thread's memory for a chunk's decoded planes, reused from chunk to chunk."""
    buffer = getattr(_contexts, "planes", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _contexts.planes = memoryview(bytearray(nbytes))
    return buffer[:nbytes]


def split_planes(raw: memoryview, width: int) -> np.ndarray:
    """Bytes of ``width``-byte elements as ``width`` planes, plane b holding byte b of every element."""
    return np.ascontiguousarray(np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T)


def join_planes(planes: memoryview, width: int, out: memoryview) -> None:
    """The inverse of :func:`split_planes`, into ``out``. Built by shifts on ``width``-byte integers:
    measured 6 GB/s for two planes, where a transposing copy managed 0.7 GB/s."""
    count = planes.nbytes // width
    source = np.frombuffer(planes, dtype=np.uint8).reshape(width, count)
    target = np.frombuffer(out, dtype=_UNSIGNED[width])
    np.copyto(target, source[width - 1], casting="unsafe")
    for plane in range(width - 2, -1, -1):
        target <<= 8
        target |= source[plane]


def _rotate_left(values: np.ndarray, bits: int) -> np.ndarray:
    """Each unsigned element rotated left by ``bits`` (its top bits, a float's sign first, become
    its lowest). Measured on trained fp32 state, by one bit: the same ratio as moving the sign just
    below the exponent and leaving the mantissa in place, and decoding 1.4x faster."""
    rotated = values << bits
    rotated |= values >> (values.dtype.itemsize * 8 - bits)
    return rotated


def _rotate_right_in_place(values: np.ndarray, bits: int, carried: np.ndarray) -> None:
    """The inverse of :func:`_rotate_left`, in place; ``carried`` (as many elements, not ``values``'
    memory) holds the bits carried around meanwhile."""
    np.left_shift(values, values.dtype.itemsize * 8 - bits, out=carried)
    values >>= bits
    values |= carried


def _compressor(level: int) -> zstandard.ZstdCompressor:
    by_level = getattr(_contexts, "compressors", None)
    if by_level is None:
        by_level = _contexts.compressors = {}
    compressor = by_level.get(level)
    if compressor is None:
        compressor = by_level[level] = zstandard.ZstdCompressor(level=level)
    return compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    decompressor = getattr(_contexts, "decompressor", None)
    if decompressor is None:
        decompressor = _contexts.decompressor = zstandard.ZstdDecompressor()
    return decompressor
