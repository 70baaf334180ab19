"""The load engine's batching and partial reads: small tensors stored back to back are read with
vectored reads and each is still verified on its own; a resharded read fetches whole checksum
chunks of the parts it needs (and skips parts it does not) and copies the wanted elements out."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

import bcp
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK
from bcp.storage import LocalStorage, Storage
from models import read_manifest

CHUNK = DEFAULT_CHECKSUM_CHUNK
ROWS, COLUMNS = 2, 3_000_000  # fp32 rows of ~11.4 MiB: each spans several checksum chunks


class CountingStorage(LocalStorage):
    """Counts the vectored reads of data files."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.data_reads = 0

    def read_into_many(self, name, offset, dests) -> None:
        self.data_reads += "/data/" in name
        super().read_into_many(name, offset, dests)


def small_state() -> dict[str, torch.Tensor]:
    """Many small tensors of mixed dtypes and shapes (0-d included), stored back to back."""
    generator = torch.Generator().manual_seed(7)
    state = {}
    for i in range(300):
        kind = i % 5
        if kind == 0:
            state[f"t{i}"] = torch.randn(17 + i, generator=generator)
        elif kind == 1:
            state[f"t{i}"] = torch.randn(3, 5, generator=generator).to(torch.bfloat16)
        elif kind == 2:
            state[f"t{i}"] = torch.randint(-99, 99, (i % 7 + 1,), generator=generator)
        elif kind == 3:
            state[f"t{i}"] = torch.randn((), generator=generator, dtype=torch.float64)
        else:
            state[f"t{i}"] = torch.rand(4, 2, generator=generator) > 0.5
    return state


def flip_byte(path, manifest, name: str, at: int) -> None:
    """Flip one stored byte of tensor ``name``'s first shard, ``at`` bytes into it."""
    stored = manifest.tensors[name].shards[0].bytes
    victim = path / f"gen-{manifest.generation:08d}" / manifest.files[stored.file]
    raw = bytearray(victim.read_bytes())
    raw[stored.offset + at] ^= 0x10
    victim.write_bytes(bytes(raw))


def test_small_tensors_are_read_together_bitwise(tmp_path):
    state = small_state()
    bcp.save(tmp_path, {"model": state})
    out = {name: torch.zeros_like(t) for name, t in state.items()}
    storage = CountingStorage(tmp_path)
    bcp.load(storage, {"model": out})
    for name, tensor in state.items():
        assert torch.equal(out[name], tensor) and out[name].dtype == tensor.dtype, name
    assert storage.data_reads < len(state) // 10  # a few vectored reads, not one per tensor


def test_corrupt_small_tensor_among_many_is_named(tmp_path):
    state = small_state()
    bcp.save(tmp_path, {"model": state})
    flip_byte(tmp_path, read_manifest(tmp_path), "model/t151", 5)
    out = {name: torch.zeros_like(t) for name, t in state.items()}
    with pytest.raises(bcp.CorruptCheckpointError, match=r"checksum mismatch in data/.*'model/t151'"):
        bcp.load(tmp_path, {"model": out})
    bcp.load(tmp_path, {"model": out}, verify=False)
    assert not torch.equal(out["t151"], state["t151"])
    assert all(torch.equal(out[n], t) for n, t in state.items() if n != "t151")


def test_truncation_inside_a_batch_names_the_first_tensor_cut(tmp_path):
    state = small_state()
    bcp.save(tmp_path, {"model": state})
    manifest = read_manifest(tmp_path)
    stored = manifest.tensors["model/t200"].shards[0].bytes
    victim = tmp_path / "gen-00000001" / manifest.files[stored.file]
    with open(victim, "r+b") as f:
        f.truncate(stored.offset + 1)
    out = {name: torch.zeros_like(t) for name, t in state.items()}
    with pytest.raises(bcp.CorruptCheckpointError, match=r"truncated.*'model/t200'"):
        bcp.load(tmp_path, {"model": out})


def row_halves(tensor: torch.Tensor) -> list[bcp.TensorShard]:
    cut = tensor.shape[0] // 2
    return [bcp.TensorShard(tensor[:cut], tuple(tensor.shape), (0, 0)),
            bcp.TensorShard(tensor[cut:], tuple(tensor.shape), (cut, 0))]


def column_pieces(shape: tuple[int, int], cuts: list[int]) -> list[bcp.TensorShard]:
    """Zeroed pieces covering all rows and the column ranges between ``cuts``."""
    return [bcp.TensorShard(torch.zeros(shape[0], end - start), shape, (0, start))
            for start, end in itertools.pairwise(cuts)]


@pytest.mark.parametrize("verify", [True, False])
def test_rows_saved_columns_loaded_bitwise(tmp_path, monkeypatch, verify):
    from bcp.engine import read_segments

    if not verify:  # parts that end mid-row, so each part's copy is cut into several boxes
        monkeypatch.setattr(read_segments, "SCRATCH_PART_BYTES", 3_000_004)
    tensor = torch.randn(6, 700_000)  # row halves of ~8 MiB: several checksum chunks each
    bcp.save(tmp_path, {"model": {"w": row_halves(tensor)}})
    shape = tuple(tensor.shape)
    pieces = column_pieces(shape, [0, 1, 350_001, 699_998, 700_000])
    bcp.load(tmp_path, {"model": {"w": pieces}}, verify=verify)
    for piece in pieces:
        start = piece.offsets[1]
        assert torch.equal(piece.tensor, tensor[:, start: start + piece.tensor.shape[1]])


def test_partial_read_skips_parts_with_nothing_wanted(tmp_path):
    tensor = torch.randn(ROWS, COLUMNS)
    bcp.save(tmp_path, {"model": {"w": tensor}})
    piece = column_pieces((ROWS, COLUMNS), [0, 1000])[0]
    result = bcp.load(tmp_path, {"model": {"w": [piece]}})
    assert torch.equal(piece.tensor, tensor[:, :1000])
    # the start of each row: the chunks of row 0 and row 1 that hold columns 0..999
    assert result.stats.bytes == 2 * CHUNK


def test_corruption_in_the_unwanted_bytes_of_a_chunk_read_is_detected(tmp_path):
    tensor = torch.randn(ROWS, COLUMNS)
    bcp.save(tmp_path, {"model": {"w": tensor}})
    manifest = read_manifest(tmp_path)
    flip_byte(tmp_path, manifest, "model/w", 4000 * 4)  # row 0, column 4000: in the first chunk, not wanted
    piece = column_pieces((ROWS, COLUMNS), [0, 1000])[0]
    with pytest.raises(bcp.CorruptCheckpointError, match=r"checksum mismatch.*'model/w'"):
        bcp.load(tmp_path, {"model": {"w": [piece]}})
    # A chunk that holds nothing wanted is not read, so its damage is not this load's concern.
    tensor_path = tmp_path / "second"
    bcp.save(tensor_path, {"model": {"w": tensor}})
    flip_byte(tensor_path, read_manifest(tensor_path), "model/w", CHUNK + 5)  # the second chunk
    bcp.load(tensor_path, {"model": {"w": [piece]}})
    assert torch.equal(piece.tensor, tensor[:, :1000])


class PlainReads(LocalStorage):
    """A backend without vectored reads of its own: the protocol's default loops over read_into."""

    read_into_many = Storage.read_into_many

    def read_into(self, name, offset, dest) -> None:
        with open(self._path(name), "rb") as f:
            f.seek(offset)
            if f.readinto(dest) != dest.nbytes:
                raise EOFError(name)


def test_backend_without_vectored_reads_loads_bitwise(tmp_path):
    state = small_state()
    bcp.save(tmp_path, {"model": state})
    out = {name: torch.zeros_like(t) for name, t in state.items()}
    bcp.load(PlainReads(tmp_path), {"model": out})
    assert all(torch.equal(out[n], t) for n, t in state.items())


def test_vectored_read_spans_many_calls_and_buffers(tmp_path, monkeypatch):
    from bcp.storage import local

    monkeypatch.setattr(local, "_IOV_MAX", 3)  # several preadv calls, each ending mid-list
    content = bytes(range(256)) * 40
    (tmp_path / "blob").write_bytes(content)
    sizes = [5, 0, 700, 1, 3000, 0, 17, 2048, 9, 1000]
    buffers = [bytearray(n) for n in sizes]
    LocalStorage(tmp_path).read_into_many("blob", 100, [memoryview(b) for b in buffers])
    assert b"".join(buffers) == content[100: 100 + sum(sizes)]
    with pytest.raises(EOFError):
        LocalStorage(tmp_path).read_into_many("blob", len(content) - 10, [memoryview(bytearray(n)) for n in (4, 7)])


def test_mapped_views_are_the_file_bytes_read_only_and_refuse_a_short_file(tmp_path):
    content = bytes(range(256)) * 300
    (tmp_path / "blob").write_bytes(content)
    sizes = [5, 0, 7000, 1, 4096, 17]
    views = LocalStorage(tmp_path).read_views("blob", 4097, sizes)  # not on a page boundary
    assert [bytes(v) for v in views] == [content[4097 + sum(sizes[:i]): 4097 + sum(sizes[:i + 1])]
                                         for i in range(len(sizes))]
    assert all(v.readonly for v in views)
    with pytest.raises(EOFError):
        LocalStorage(tmp_path).read_views("blob", len(content) - 10, [4, 7])


class ThreadRecordingStorage(LocalStorage):
    """Records, per reading thread, the (file, offset) of each data read."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.reads: dict[int, list[tuple[str, int]]] = {}
        self._lock = threading.Lock()

    def read_into_many(self, name, offset, dests) -> None:
        if "/data/" in name:
            with self._lock:
                self.reads.setdefault(threading.get_ident(), []).append((name, offset))
        super().read_into_many(name, offset, dests)


def test_lanes_start_each_worker_on_a_file_of_its_own_then_help_the_fullest():
    """The schedule itself (no threads, so no scheduling luck): worker ``i`` takes the ``i``-th
    file's batches in file order; once its lane is empty it helps the lane with most bytes left."""
    from bcp.engine.read_lanes import Lanes
    from bcp.engine.read_segments import Segment
    from bcp.layout.shard_table import ByteRange

    def batch(file: int, offset: int, nbytes: int) -> list[Segment]:
        return [Segment(ByteRange(file, offset, nbytes, ()), 0, nbytes, None, None, None)]

    sizes = {0: [10, 10], 1: [10], 2: [50, 50, 50], 3: [20, 20]}
    batches = [batch(f, i * 100, n) for f, ns in sizes.items() for i, n in enumerate(ns)]
    lanes = Lanes(batches)

    def taken(worker: int) -> tuple[int, int, int]:
        """(file, offset) of the batch ``worker`` takes, and the lane it came from."""
        batch_taken, lane = lanes.take(worker)
        return batch_taken[0].where.file, batch_taken[0].where.offset, lane

    assert [taken(w) for w in range(4)] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)]
    assert taken(1) == (2, 100, 2)  # lane 1 is empty: the fullest lane is file 2's
    assert taken(0) == (0, 100, 0)
    assert taken(0) == (2, 200, 2)  # file 2 has 50 bytes left, file 3 only 20
    assert taken(0) == (3, 100, 3)
    assert lanes.take(0) is None and lanes.take(3) is None


def test_each_reader_thread_streams_its_files_forward(tmp_path, monkeypatch):
    """With as many threads as files, every thread reads each file it touches in file order (as a
    raw parallel read of the files would), and every byte is still loaded bitwise. Which thread
    starts on which file is the schedule's test above: here a late-starting thread may find its
    lane already taken over."""
    from bcp.engine import read_segments

    monkeypatch.setattr(read_segments, "READ_PART_BYTES", 4 << 20)  # several parts per file
    generator = torch.Generator().manual_seed(11)
    state = {f"w{i}": torch.randn(1 << 20, 4, generator=generator) for i in range(8)}  # 4 files of 32 MiB
    bcp.save(tmp_path, {"model": state}, io_threads=4)
    storage = ThreadRecordingStorage(tmp_path)
    dest = {name: torch.zeros_like(t) for name, t in state.items()}
    bcp.load(storage, {"model": dest}, io_threads=4)
    assert all(torch.equal(dest[n], state[n]) for n in state)
    assert len(read_manifest(tmp_path).files) == 4
    assert len({name for reads in storage.reads.values() for name, _ in reads}) == 4
    for reads in storage.reads.values():
        by_file: dict[str, list[int]] = {}
        for name, offset in reads:
            by_file.setdefault(name, []).append(offset)
        assert all(offsets == sorted(offsets) for offsets in by_file.values())


class ScratchCounter:
    """Counts the bytes the reader copies out of scratch memory (the rest went straight into the
    destination)."""

    def __init__(self, monkeypatch) -> None:
        from bcp.engine import read_segments

        self.nbytes = 0
        copy_out, copy_bytes = read_segments._copy_out, read_segments._copy_bytes

        def counting_copy_out(piece, shard, boxes, first_element, scratch):
            self.nbytes += sum(box.numel for box in boxes) * piece.tensor.element_size()
            copy_out(piece, shard, boxes, first_element, scratch)

        def counting_copy_bytes(dests, skip, scratch):
            self.nbytes += sum(dest.nbytes for dest in dests)
            copy_bytes(dests, skip, scratch)

        monkeypatch.setattr(read_segments, "_copy_out", counting_copy_out)
        monkeypatch.setattr(read_segments, "_copy_bytes", counting_copy_bytes)


@pytest.mark.parametrize("verify", [True, False])
def test_saved_shards_read_straight_into_part_of_a_larger_destination(tmp_path, monkeypatch, verify):
    """Row halves saved by two ranks, loaded whole by one (2 -> 1): each half is one contiguous run
    of the destination, read straight into it; with verification only the chunks that straddle
    the cut between the halves go through scratch, and every stored byte is read once."""
    tensor = torch.randn(7, 1_000_003)  # halves of 3 and 4 rows: ~11 and ~15 MiB, cut mid-chunk
    bcp.save(tmp_path, {"model": {"w": row_halves(tensor)}})
    counter = ScratchCounter(monkeypatch)
    out = torch.zeros_like(tensor)
    result = bcp.load(tmp_path, {"model": {"w": out}}, verify=verify)
    assert torch.equal(out, tensor)
    assert result.stats.bytes == tensor.numel() * 4
    # The halves are stored as separate ranges, each from its own chunk 0: each half's last chunk
    # ends at its stored end, so nothing needs scratch either way.
    assert counter.nbytes == 0


def test_flat_shard_read_straight_into_its_boxes_with_partial_chunks_through_scratch(tmp_path, monkeypatch):
    """A flat range (as FSDP and ZeRO hold) of a whole saved tensor, starting and ending inside
    checksum chunks: its boxes' runs are read straight into its memory, and only the two partly
    wanted chunks at the ends go through scratch (whole, so their checksums are still verified)."""
    rows, columns = 9, 1_000_000
    tensor = torch.randn(rows, columns)
    bcp.save(tmp_path, {"model": {"w": tensor}})
    start, length = 1_500_000, 5_000_001  # elements: starts mid-row and mid-chunk, ends mid-row
    flat = bcp.FlatShard(torch.zeros(length), (rows, columns), start)
    counter = ScratchCounter(monkeypatch)
    result = bcp.load(tmp_path, {"model": {"w": flat}})
    assert torch.equal(flat.tensor, tensor.flatten()[start: start + length])
    chunk_elements = CHUNK // 4
    head = -(-start // chunk_elements) * chunk_elements - start
    tail = (start + length) - (start + length) // chunk_elements * chunk_elements
    assert counter.nbytes == (head + tail) * 4
    assert result.stats.bytes == (-(-(start + length) // chunk_elements) - start // chunk_elements) * CHUNK


def test_corruption_in_a_chunk_read_straight_into_a_part_of_the_destination_is_detected(tmp_path):
    tensor = torch.randn(7, 1_000_003)
    bcp.save(tmp_path, {"model": {"w": row_halves(tensor)}})
    manifest = read_manifest(tmp_path)
    flip_byte(tmp_path, manifest, "model/w", 5 * CHUNK + 3)  # inside the first half, read straight
    with pytest.raises(bcp.CorruptCheckpointError, match=r"checksum mismatch in data/.*'model/w'"):
        bcp.load(tmp_path, {"model": {"w": torch.zeros_like(tensor)}})


def test_flat_shard_without_verification_reads_just_its_bytes(tmp_path, monkeypatch):
    rows, columns = 9, 1_000_000
    tensor = torch.randn(rows, columns)
    bcp.save(tmp_path, {"model": {"w": tensor}})
    start, length = 1_500_000, 5_000_001
    flat = bcp.FlatShard(torch.zeros(length), (rows, columns), start)
    counter = ScratchCounter(monkeypatch)
    result = bcp.load(tmp_path, {"model": {"w": flat}}, verify=False)
    assert torch.equal(flat.tensor, tensor.flatten()[start: start + length])
    assert counter.nbytes == 0 and result.stats.bytes == length * 4


def test_corruption_outside_a_flat_shard_in_a_chunk_it_reads_is_detected(tmp_path):
    """The first chunk a flat shard needs is partly someone else's: a flipped byte in that other
    part still fails the chunk's checksum."""
    rows, columns = 9, 1_000_000
    tensor = torch.randn(rows, columns)
    bcp.save(tmp_path, {"model": {"w": tensor}})
    start, length = 1_500_000, 5_000_001
    flip_byte(tmp_path, read_manifest(tmp_path), "model/w", start * 4 - 8)  # just before the shard
    flat = bcp.FlatShard(torch.zeros(length), (rows, columns), start)
    with pytest.raises(bcp.CorruptCheckpointError, match=r"checksum mismatch in data/.*'model/w'"):
        bcp.load(tmp_path, {"model": {"w": flat}})


def test_a_worker_reads_a_file_through_one_descriptor_from_part_to_part(tmp_path, monkeypatch):
    """The kernel's readahead runs on from one part of a file to the next only through one
    descriptor: a tensor read in 8 parts opens its file once per reader thread, not once per part."""
    from bcp.engine import read_segments
    from bcp.storage import local

    state = {"w": torch.randn(8 * CHUNK // 4, generator=torch.Generator().manual_seed(3))}
    bcp.save(tmp_path, state, io_threads=1)
    monkeypatch.setattr(read_segments, "READ_PART_BYTES", CHUNK)  # 8 parts of one chunk
    opened, open_regular = [], local._open_regular
    monkeypatch.setattr(local, "_open_regular", lambda path: opened.append(path) or open_regular(path))
    storage = CountingStorage(tmp_path)
    out = {"w": torch.zeros_like(state["w"])}
    bcp.load(storage, out, io_threads=2)
    assert torch.equal(out["w"], state["w"])
    assert storage.data_reads == 8 and sum("/data/" in path for path in opened) <= 2


def test_a_kept_descriptor_reads_its_file_until_the_block_ends_and_is_closed(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.write_file("f.bin", [memoryview(bytes(range(256)) * 16)])
    first, second = bytearray(16), bytearray(16)
    with storage.descriptors_kept():
        storage.read_into_many("f.bin", 0, [memoryview(first)])
        (tmp_path / "f.bin").unlink()  # the kept descriptor still reads the file's bytes
        storage.read_into_many("f.bin", 256, [memoryview(second)])
    assert bytes(first) == bytes(second) == bytes(range(16))
    with pytest.raises(FileNotFoundError):  # the block closed it: a read opens the name again
        storage.read_into_many("f.bin", 0, [memoryview(first)])
