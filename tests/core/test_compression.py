"""Compressed checkpoints (format version 4): the chunk codec, the shard table's columns of stored
chunks and their validation, saves and loads that compress, and reads that decode only the chunks
they need."""

from __future__ import annotations

import struct
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
import zstandard

import bcp
import bcp.tools
from bcp.integration import reset_runtime
from bcp.chunk_codecs import (RAW, ZSTD, ZSTD_EXPONENT_MANTISSA_PLANES, ZSTD_EXPONENT_PLANES, ZSTD_PLANES,
                              ChunkDecodeError, Compression, codec_for, compress_chunk, decompress_chunk, join_planes,
                              split_planes)
from bcp.errors import CorruptCheckpointError
from bcp.layout.box import Box
from bcp.layout.dtypes import exponent_bits, plane_width
from bcp.layout.manifest import Manifest, TensorEntry
from bcp.layout.shard_table import ByteRange, ShardEntry, StoredChunks
from bcp.storage import LocalStorage
from models import rank, read_manifest
from test_read_batching import flip_byte

CHUNK = 1 << 20
FIXTURES = Path(__file__).parent.parent / "fixtures"


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


def _round_trip(raw: memoryview, codec: int, width: int) -> tuple[int, bytes]:
    coded, stored = compress_chunk(raw, codec, width, 1)
    out = bytearray(raw.nbytes)
    decompress_chunk(stored, coded, width, memoryview(out))
    return coded, bytes(out)


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    tiny = torch.finfo(dtype).tiny
    values = torch.tensor([0.0, -0.0, 1.0, -2.0, float("inf"), float("-inf"), float("nan"), tiny, -tiny,
                           tiny / 4, -tiny / 1024, torch.finfo(dtype).max, torch.finfo(dtype).min], dtype=dtype)
    return torch.cat([values, _trained_like(dtype, 4000)])


ROTATING = [ZSTD_EXPONENT_PLANES, ZSTD_EXPONENT_MANTISSA_PLANES]


@pytest.mark.parametrize("codec", ROTATING)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.complex64])
def test_exponent_planes_round_trip_special_values_and_random_bytes_bitwise(dtype, codec):
    width = plane_width(dtype)
    special = _bytes_of(_special_values(dtype))
    negative_nan = torch.tensor([float("nan")], dtype=dtype).neg()
    assert _round_trip(special, codec, width) == (codec, special.tobytes())
    for raw in (_bytes_of(negative_nan.repeat(1000)),
                memoryview(np.random.default_rng(7).integers(0, 256, 3000 * width, dtype=np.uint8)),
                memoryview(np.random.default_rng(8).integers(0, 2, 3000 * width, dtype=np.uint8) * 255)):
        coded, out = _round_trip(raw, codec, width)
        assert coded in (RAW, codec) and out == raw.tobytes()


@pytest.mark.parametrize("codec", ROTATING)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exponent_planes_round_trip_every_size_of_whole_elements_bitwise(dtype, codec):
    values = _special_values(dtype)
    for count in (1, 2, 3, 7, 13, 1001, values.numel()):
        raw = _bytes_of(values[-count:])
        coded, out = _round_trip(raw, codec, plane_width(dtype))
        assert coded in (RAW, codec) and out == raw.tobytes()


def test_exponent_planes_put_the_whole_exponent_in_the_top_plane():
    # the format's definition: each element rotated left one bit, then byte planes (docs/format.md)
    raw = _bytes_of(torch.tensor([1.0, -2.0, -0.0] * 200, dtype=torch.bfloat16))  # 0x3f80, 0xc000, 0x8000
    codec, stored = compress_chunk(raw, ZSTD_EXPONENT_PLANES, 2, 1)
    planes = np.frombuffer(zstandard.ZstdDecompressor().decompress(stored), dtype=np.uint8).reshape(2, -1)
    assert codec == ZSTD_EXPONENT_PLANES
    assert planes[1, :3].tolist() == [127, 128, 0] and planes[0, :3].tolist() == [0x00, 0x01, 0x01]


def test_exponent_and_mantissa_planes_put_six_exponent_bits_and_two_mantissa_bits_in_the_top_plane():
    # the format's definition: each element rotated left three bits, then byte planes (docs/format.md)
    raw = _bytes_of(torch.tensor([1.0, -1.75, -0.0] * 200, dtype=torch.bfloat16))  # 0x3f80, 0xbfe0, 0x8000
    codec, stored = compress_chunk(raw, ZSTD_EXPONENT_MANTISSA_PLANES, 2, 1)
    planes = np.frombuffer(zstandard.ZstdDecompressor().decompress(stored), dtype=np.uint8).reshape(2, -1)
    assert codec == ZSTD_EXPONENT_MANTISSA_PLANES
    # 1.0: exponent 0b01111111, mantissa 0 -> top 0b111111_00, bottom 0b00000_0_01 (sign 0, exponent's top bits 01)
    # -1.75: mantissa 0b1100000 -> top 0b111111_11, bottom 0b00000_1_01; -0.0: only the sign -> 0b100
    assert planes[1, :3].tolist() == [0b11111100, 0b11111111, 0]
    assert planes[0, :3].tolist() == [0b001, 0b101, 0b100]


@pytest.mark.parametrize("codec", ROTATING)
def test_exponent_planes_refuse_what_they_cannot_have_written(codec):
    raw = _bytes_of(_trained_like(torch.float32, 4096))
    coded, stored = compress_chunk(raw, codec, 4, 1)
    assert coded == codec
    with pytest.raises(ChunkDecodeError, match="width 3"):
        decompress_chunk(stored, codec, 3, memoryview(bytearray(raw.nbytes)))
    with pytest.raises(ChunkDecodeError, match="cannot make"):  # not whole elements
        decompress_chunk(stored, codec, 4, memoryview(bytearray(raw.nbytes - 2)))
    with pytest.raises(ChunkDecodeError):  # a frame that makes more than the chunk holds
        decompress_chunk(stored, codec, 4, memoryview(bytearray(raw.nbytes - 4)))
    with pytest.raises(ChunkDecodeError):  # truncated
        decompress_chunk(stored[:-5], codec, 4, memoryview(bytearray(raw.nbytes)))


@pytest.mark.parametrize("codec", ROTATING)
def test_an_exponent_planes_chunk_that_is_not_whole_elements_falls_back_to_whole_bytes(codec):
    raw = _bytes_of(_trained_like(torch.float32, 1000))[:3999]
    assert _round_trip(raw, codec, 4) == (ZSTD, raw.tobytes())


def test_the_writer_codes_8_bit_exponents_in_exponent_and_mantissa_planes_and_others_in_byte_planes():
    chosen = {d: codec_for(plane_width(d), exponent_bits(d)) for d in (torch.bfloat16, torch.float32, torch.complex64,
                                                                        torch.float16, torch.float64, torch.int32)}
    assert chosen == {torch.bfloat16: ZSTD_EXPONENT_MANTISSA_PLANES, torch.float32: ZSTD_EXPONENT_MANTISSA_PLANES,
                      torch.complex64: ZSTD_EXPONENT_MANTISSA_PLANES, torch.float16: ZSTD_PLANES,
                      torch.float64: ZSTD_PLANES, torch.int32: ZSTD}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_rotation_beats_the_one_before_on_trained_like_values(dtype):
    raw = _bytes_of(_trained_like(dtype, CHUNK // torch.empty((), dtype=dtype).element_size()))
    sizes = [compress_chunk(raw, codec, plane_width(dtype), 1)[1].nbytes
             for codec in (ZSTD_PLANES, ZSTD_EXPONENT_PLANES, ZSTD_EXPONENT_MANTISSA_PLANES)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3


def test_the_format_4_fixture_keeps_chunks_in_byte_planes():
    # written before exponent planes existed: it keeps codec 2 (byte planes) read and tested
    manifest = read_manifest(FIXTURES / "format-v4")
    codecs = {c for e in manifest.tensors.values() for s in e.shards if s.bytes.stored for c in s.bytes.stored.codecs}
    assert ZSTD_PLANES in codecs


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
    ((9, RAW, RAW), "codec id 9 .*newer bcp"),
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


# --- saves and loads -------------------------------------------------------------------------------

class CountedReads(LocalStorage):
    """Records every read of a data file: ``(name, offset, nbytes)``, through either read path."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int, int]] = []

    def read_into_many(self, name, offset, dests):
        if "/data/" in name:
            self.reads.append((name, offset, sum(memoryview(d).nbytes for d in dests)))
        return super().read_into_many(name, offset, dests)

    def read_views(self, name, offset, sizes):
        if "/data/" in name:
            self.reads.append((name, offset, sum(sizes)))
        return super().read_views(name, offset, sizes)


def chunks_read(reads: list[tuple[str, int, int]], manifest: Manifest, name: str) -> list[set[int]]:
    """For each shard of tensor ``name``, the chunks whose stored bytes the reads fetched; every read
    must be whole stored chunks (of one or several shards)."""
    out = []
    for shard in manifest.tensors[name].shards:
        where, file = shard.bytes, manifest.files[shard.bytes.file]
        bounds = [where.offset + s for s in where.stored.starts()]
        hit = set()
        for read_file, offset, nbytes in reads:
            if not read_file.endswith(file) or offset >= bounds[-1] or offset + nbytes <= bounds[0]:
                continue
            assert max(offset, bounds[0]) in bounds and min(offset + nbytes, bounds[-1]) in bounds, \
                f"a read of [{offset}, {offset + nbytes}) is not whole stored chunks of {bounds}"
            hit |= {j for j in range(len(bounds) - 1) if offset <= bounds[j] < offset + nbytes}
        out.append(hit)
    return out


def trained_like_state() -> dict[str, torch.Tensor]:
    return {"w": _trained_like(torch.bfloat16, 4096 * 1024).reshape(4096, 1024),   # 8 chunks
            "master": _trained_like(torch.float32, 3 * CHUNK // 4 + 1000),           # 4 chunks, the last short
            "noise": torch.randint(0, 256, (CHUNK + 77,), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(5))}       # incompressible


ROUND_TRIP_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                     torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
ROUND_TRIP_DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]


def _value(dtype: torch.dtype, n: int) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.arange(n) % 3 == 0
    if dtype.is_floating_point or dtype.is_complex:
        return _trained_like(torch.float32 if dtype.itemsize < 2 else dtype, n).to(dtype)
    return (torch.arange(n) % 100).to(dtype)


def test_every_dtype_round_trips_bitwise_compressed(tmp_path):
    state = {str(d).removeprefix("torch."): _value(d, 300_001) for d in ROUND_TRIP_DTYPES}
    state |= {"small": torch.arange(7, dtype=torch.float32), "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
              "empty": torch.empty(0, 3, dtype=torch.float16)}
    bcp.save(tmp_path, state, compression="zstd", metrics_log=False)
    manifest = read_manifest(tmp_path)
    assert manifest.version == 4 and manifest.compression == Compression("zstd", 1)
    codecs = {name: {c for s in e.shards for c in (s.bytes.stored.codecs if s.bytes.stored else (RAW,))}
              for name, e in manifest.tensors.items()}
    assert codecs["bfloat16"] == codecs["float32"] == codecs["complex64"] == {ZSTD_EXPONENT_MANTISSA_PLANES}
    assert codecs["float16"] == codecs["float64"] == {ZSTD_PLANES} and codecs["int64"] == {ZSTD}
    assert codecs["scalar"] == {RAW} and codecs["empty"] <= {RAW}  # too small to shrink
    assert codecs["small"] == {ZSTD_EXPONENT_MANTISSA_PLANES}  # 0.0 .. 6.0: zero low planes, 28 bytes in fewer
    live = {name: torch.zeros_like(t) for name, t in state.items()}
    bcp.load(tmp_path, live, metrics_log=False)
    for name, tensor in state.items():
        assert torch.equal(live[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    assert bcp.tools.verify_checkpoint(tmp_path).ok and bcp.tools.verify_checkpoint(tmp_path, decode=True).ok


def test_incompressible_chunks_are_stored_raw_and_the_file_holds_the_stored_bytes(tmp_path):
    state = trained_like_state()
    bcp.save(tmp_path, state, compression=bcp.Compression(level=1), metrics_log=False)
    manifest = read_manifest(tmp_path)
    noise = manifest.tensors["noise"].shards[0].bytes
    assert noise.stored is None  # every chunk raw: read as an uncompressed shard
    weights = manifest.tensors["w"].shards[0].bytes
    assert set(weights.stored.codecs) == {ZSTD_EXPONENT_MANTISSA_PLANES} and weights.nbytes / weights.stored_nbytes > 1.3
    stored = sum(s.bytes.stored_nbytes for e in manifest.tensors.values() for s in e.shards)
    data = tmp_path / f"gen-{manifest.generation:08d}" / manifest.files[0]
    assert data.stat().st_size == stored  # values aside, which this state has none of
    live = {name: torch.zeros_like(t) for name, t in state.items()}
    bcp.load(tmp_path, live, metrics_log=False)
    assert all(torch.equal(live[n], state[n]) for n in state)


def test_an_uncompressed_save_is_unchanged(tmp_path):
    bcp.save(tmp_path, trained_like_state(), metrics_log=False)
    manifest = read_manifest(tmp_path)
    assert manifest.version == 1 and manifest.compression is None
    assert all(s.bytes.stored is None for e in manifest.tensors.values() for s in e.shards)


@pytest.mark.parametrize("writer", ["process", "threads"])
def test_an_asynchronous_save_compresses_in_the_writer_process_or_threads(tmp_path, writer):
    state = trained_like_state()
    bcp.save(tmp_path, state, compression="zstd", async_save=True, async_writer=writer, metrics_log=False).wait()
    reset_runtime()  # its staging buffers go: tests after this one count the buffers they make
    manifest = read_manifest(tmp_path)
    assert manifest.version == 4
    assert set(manifest.tensors["w"].shards[0].bytes.stored.codecs) == {ZSTD_EXPONENT_MANTISSA_PLANES}
    live = {name: torch.zeros_like(t) for name, t in state.items()}
    bcp.load(tmp_path, live, metrics_log=False)
    assert all(torch.equal(live[n], state[n]) for n in state)


def test_an_unknown_codec_is_refused_clearly(tmp_path):
    with pytest.raises(bcp.CheckpointError, match="unknown compression codec 'brotli'"):
        bcp.save(tmp_path, {"w": torch.zeros(3)}, compression="brotli")


def test_a_slice_through_read_tensor_decodes_only_the_chunks_that_hold_it(tmp_path):
    state = trained_like_state()
    bcp.save(tmp_path, state, compression="zstd", metrics_log=False)
    manifest = read_manifest(tmp_path)
    storage = CountedReads(tmp_path)
    rows = bcp.tools.read_tensor(storage, "w", (slice(1000, 1100),))  # bytes [2,048,000, 2,252,800)
    assert torch.equal(rows, state["w"][1000:1100])
    assert chunks_read(storage.reads, manifest, "w") == [{1, 2}]
    storage.reads.clear()
    column = bcp.tools.read_tensor(storage, "w", (slice(None), 3))  # strided: every chunk holds some
    assert torch.equal(column, state["w"][:, 3])
    assert chunks_read(storage.reads, manifest, "w") == [set(range(8))]
    storage.reads.clear()
    tail = bcp.tools.read_tensor(storage, "master", (slice(3 * CHUNK // 4 + 10, None),))  # in the short last chunk
    assert torch.equal(tail, state["master"][3 * CHUNK // 4 + 10:])
    assert chunks_read(storage.reads, manifest, "master") == [{3}]


def save_rows(path: str, parts: int) -> None:
    """Rank r saves rows r/parts of ``w`` (compressed)."""
    full = trained_like_state()["w"]
    rows = full.shape[0] // parts
    shard = bcp.TensorShard(full[rank() * rows:(rank() + 1) * rows].clone(), tuple(full.shape), (rank() * rows, 0))
    bcp.save(path, {"model": {"w": shard}}, compression="zstd", metrics_log=False)


def load_rows(path: str, parts: int) -> tuple[bool, list[tuple[str, int, int]]]:
    """Rank r loads rows r/parts of ``w``: whether they are bitwise right, and its data reads."""
    full = trained_like_state()["w"]
    rows = full.shape[0] // parts
    start, end = rank() * rows, (rank() + 1) * rows if rank() < parts - 1 else full.shape[0]
    live = bcp.TensorShard(torch.zeros(end - start, full.shape[1], dtype=full.dtype), tuple(full.shape), (start, 0))
    storage = CountedReads(path)
    bcp.load(storage, {"model": {"w": live}}, metrics_log=False)
    return torch.equal(live.tensor, full[start:end]), storage.reads


def test_two_ranks_saved_compressed_load_into_one_reading_every_chunk_once(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_rows, path, 2)
    right, reads = load_rows(path, 1)
    assert right
    manifest = read_manifest(path)
    assert chunks_read(reads, manifest, "model/w") == [set(range(4)), set(range(4))]
    stored = sum(s.bytes.stored_nbytes for s in manifest.tensors["model/w"].shards)
    assert sum(n for _, _, n in reads) == stored  # each chunk read once


def test_one_rank_saved_compressed_loads_into_three_each_reading_only_its_chunks(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    save_rows(path, 1)
    results = ranks(3).run(load_rows, path, 3)
    manifest = read_manifest(path)
    # rows of 2 KiB: rank 0 rows [0, 1365) = bytes [0, 2.67 MiB), rank 1 [1365, 2730), rank 2 the rest
    assert [right for right, _ in results] == [True, True, True]
    assert [chunks_read(reads, manifest, "model/w") for _, reads in results] == [[{0, 1, 2}], [{2, 3, 4, 5}],
                                                                                 [{5, 6, 7}]]


def test_a_flipped_byte_in_a_compressed_chunk_is_named_by_verify_and_refused_by_a_load(tmp_path):
    state = trained_like_state()
    bcp.save(tmp_path, state, compression="zstd", metrics_log=False)
    manifest = read_manifest(tmp_path)
    starts = manifest.tensors["w"].shards[0].bytes.stored.starts()
    flip_byte(tmp_path, manifest, "w", starts[5] + 100)
    report = bcp.tools.verify_checkpoint(tmp_path)
    assert [(p.entry, "compressed chunk 5" in p.message) for p in report.problems] == [("w", True)]
    live = {name: torch.full_like(t, 3) for name, t in state.items()}
    with pytest.raises(bcp.CorruptCheckpointError, match=r"compressed chunk 5 .*entry 'w'"):
        bcp.load(tmp_path, live, metrics_log=False)
    assert all(torch.equal(t, torch.full_like(t, 3)) for t in live.values())  # nothing placed
    # a slice that does not reach the damaged chunk still reads
    assert torch.equal(bcp.tools.read_tensor(tmp_path, "w", (slice(0, 10),)), state["w"][:10])


def test_a_damaged_frame_is_refused_even_without_verification(tmp_path):
    state = trained_like_state()
    bcp.save(tmp_path, state, compression="zstd", metrics_log=False)
    flip_byte(tmp_path, read_manifest(tmp_path), "w", 0)  # the first frame's magic number
    with pytest.raises(bcp.CorruptCheckpointError, match=r"compressed chunk 0 .* does not decode to its 1048576 bytes"):
        bcp.load(tmp_path, {name: torch.zeros_like(t) for name, t in state.items()}, verify=False, metrics_log=False)


def test_a_truncated_data_file_of_compressed_chunks_is_refused_clearly(tmp_path):
    state = trained_like_state()
    bcp.save(tmp_path, state, compression="zstd", metrics_log=False)
    manifest = read_manifest(tmp_path)
    data = tmp_path / f"gen-{manifest.generation:08d}" / manifest.files[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(bcp.CorruptCheckpointError, match="truncated"):
        bcp.load(tmp_path, {name: torch.zeros_like(t) for name, t in state.items()}, metrics_log=False)
    assert not bcp.tools.verify_checkpoint(tmp_path).ok


def test_a_bcp_that_reads_only_earlier_versions_refuses_a_version_4_checkpoint(tmp_path, monkeypatch):
    import bcp.layout.manifest as manifest

    bcp.save(tmp_path, {"w": _trained_like(torch.bfloat16, CHUNK)}, compression="zstd", metrics_log=False)
    monkeypatch.setattr(manifest, "SUPPORTED_VERSIONS", (1, 2, 3))
    with pytest.raises(bcp.FormatVersionError, match="format version 4 is not readable by this bcp"):
        bcp.load(tmp_path, {"w": torch.zeros(CHUNK, dtype=torch.bfloat16)}, metrics_log=False)


def load_whole_read_once(path: str) -> tuple[bool, int]:
    """Every rank loads the whole of ``w`` with ``read_once``: whether it is bitwise right, and the
    stored bytes this rank read."""
    full = trained_like_state()["w"]
    live = {"model": {"w": torch.zeros_like(full)}}
    storage = CountedReads(path)
    bcp.load(storage, live, read_once=True, metrics_log=False)
    return torch.equal(live["model"]["w"], full), sum(n for _, _, n in storage.reads)


def test_replicas_read_once_share_decoded_bytes(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    save_rows(path, 1)
    results = ranks(2).run(load_whole_read_once, path)
    stored = read_manifest(path).tensors["model/w"].shards[0].bytes.stored_nbytes
    assert [right for right, _ in results] == [True, True]
    assert sum(nbytes for _, nbytes in results) == stored  # read by one rank, received by the other
