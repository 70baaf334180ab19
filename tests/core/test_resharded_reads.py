"""Resharded loads on real process groups: each rank's wanted bytes are strided in the saved bytes
(rows saved, columns loaded) or in its destination (columns saved, rows loaded), so they are
verified in whole checksum chunks and copied out of a read-only mapping of the data files. Rows of
every size (several chunks, a few KiB as in a transformer, a few bytes), uneven cuts, and a saved
world of 2 loaded by 1; every value is compared bitwise, and a flipped byte is found on every rank
that reads its chunk, leaving every rank's live state as it was."""

from __future__ import annotations

import pytest
import torch

import bcp
from bcp.storage import LocalStorage
from models import rank, read_manifest

SHAPES = {"big": (9, 700_001), "mid": (301, 1151), "tiny": (1001, 3), "flat": (7,)}
DTYPES = {"big": torch.float32, "mid": torch.float32, "tiny": torch.float16, "flat": torch.int64}


def reference(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return (torch.randn(SHAPES[name], generator=g) * 100).to(DTYPES[name])


def _span(length: int, part: int, parts: int) -> tuple[int, int]:
    """Part ``part`` of ``parts`` of ``length`` items, the first parts one longer (uneven cuts)."""
    base, extra = divmod(length, parts)
    start = part * base + min(part, extra)
    return start, start + base + (part < extra)


def pieces(dim: int | None, part: int, parts: int, fill: bool) -> dict[str, bcp.TensorShard]:
    """Each tensor cut on ``dim`` (None: whole; a 1-D tensor is cut on its only dim)."""
    out = {}
    for name, shape in SHAPES.items():
        full = reference(name) if fill else torch.zeros(shape, dtype=DTYPES[name])
        offsets = [0] * len(shape)
        if dim is not None:
            cut = min(dim, len(shape) - 1)
            start, end = _span(shape[cut], part, parts)
            offsets[cut] = start
            full = full.narrow(cut, start, end - start).contiguous()
        out[name] = bcp.TensorShard(full, shape, tuple(offsets))
    return out


class MappedReads(LocalStorage):
    """Counts the data reads served as views of a mapping."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.mapped = 0

    def read_views(self, name, offset, sizes):
        self.mapped += "/data/" in name
        return super().read_views(name, offset, sizes)


def save_cut(path: str, dim: int, parts: int) -> None:
    bcp.save(path, {"model": pieces(dim, rank(), parts, fill=True)})


def load_cut(path: str, dim: int | None, parts: int) -> tuple[list[str], int]:
    """Load this rank's cut; the tensors that differ from the saved values, and the mapped reads."""
    live = pieces(dim, rank(), parts, fill=False)
    storage = MappedReads(path)
    bcp.load(storage, {"model": live})
    wrong = [name for name, piece in live.items()
             if not torch.equal(piece.tensor, pieces(dim, rank(), parts, fill=True)[name].tensor)]
    return wrong, storage.mapped


@pytest.mark.parametrize("saved_dim,loaded_dim", [(0, 1), (1, 0)], ids=["rows->columns", "columns->rows"])
def test_resharded_load_between_two_ranks_is_bitwise(ranks, tmp_path, saved_dim, loaded_dim):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_cut, path, saved_dim, 2)
    results = ranks(2).run(load_cut, path, loaded_dim, 2)
    assert [wrong for wrong, _ in results] == [[], []]
    assert all(mapped for _, mapped in results)  # the strided reads went through the mapping


def test_two_ranks_rows_loaded_whole_by_one_is_bitwise(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_cut, path, 0, 2)
    wrong, _ = load_cut(path, None, 1)
    assert wrong == []


def load_expecting_damage(path: str, dim: int, parts: int) -> tuple[str, list[str]]:
    """A load that must fail: its error, and the tensors whose live values it changed."""
    live = pieces(dim, rank(), parts, fill=False)
    for piece in live.values():
        piece.tensor.fill_(7)
    before = {name: piece.tensor.clone() for name, piece in live.items()}
    try:
        bcp.load(path, {"model": live})
    except bcp.CheckpointError as exc:
        return str(exc), [name for name, piece in live.items() if not torch.equal(piece.tensor, before[name])]
    return "loaded", []


def test_a_flipped_byte_in_a_half_wanted_row_is_found_and_nothing_moves(ranks, tmp_path):
    """Rank 1's saved rows of ``mid`` with one byte flipped in column 1000 of its third row: rank 1
    places that byte, rank 0 only reads the chunk holding it (it wants columns 0..575)."""
    path = tmp_path / "ckpt"
    ranks(2).run(save_cut, str(path), 0, 2)
    manifest = read_manifest(path)
    shard = next(s for s in manifest.tensors["model/mid"].shards if s.box.offsets[0] > 0)
    data = path / f"gen-{manifest.generation:08d}" / manifest.files[shard.bytes.file]
    raw = bytearray(data.read_bytes())
    raw[shard.bytes.offset + (2 * 1151 + 1000) * 4 + 1] ^= 0x01
    data.write_bytes(bytes(raw))
    results = ranks(2).run(load_expecting_damage, str(path), 1, 2)
    for error, moved in results:
        assert moved == []
        assert "'model/mid'" in error or "another rank" in error, error
    assert any("checksum mismatch" in error and "'model/mid'" in error for error, _ in results)
