"""Small checkpoints with every saved layout, written by one process, for the tools' tests."""

from __future__ import annotations

import hashlib
import os

import torch

import bcp
from bcp.tools import open_checkpoint


def sharded_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint whose tensors are saved whole, cut along one dim, in a 2 x 2 grid and as flat
    (irregular) pieces, plus a bfloat16, an int and a 0-d tensor, a tensor held by a value, and two
    values; returns the tensors."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model/embed.weight": torch.randn(10, 6, generator=g),
        "model/grid.weight": torch.randn(6, 8, generator=g),
        "model/flat.weight": torch.randn(5, 3, generator=g),
        "model/norm.weight": torch.randn(6, generator=g).to(torch.bfloat16),
        "model/positions": torch.arange(12, dtype=torch.int64),
        "model/scale": torch.tensor(0.5),
    }
    grid = tensors["model/grid.weight"]
    flat = tensors["model/flat.weight"].reshape(-1)
    model = {
        "embed.weight": [bcp.TensorShard(tensors["model/embed.weight"][i:i + 5], (10, 6), (i, 0)) for i in (0, 5)],
        "grid.weight": [bcp.TensorShard(grid[r:r + 3, c:c + 4], (6, 8), (r, c)) for r in (0, 3) for c in (0, 4)],
        "flat.weight": [bcp.FlatShard(flat[a:b], (5, 3), a) for a, b in ((0, 4), (4, 11), (11, 15))],
        "norm.weight": tensors["model/norm.weight"],
        "positions": tensors["model/positions"],
        "scale": tensors["model/scale"],
        "note": "a non-tensor model entry",
    }
    tensors["extra_state/rng"] = torch.arange(4, dtype=torch.uint8)
    bcp.save(path, {"model": model, "extra_state": {"step": 7, "rng": tensors["extra_state/rng"]}})
    return tensors


def tree_digest(path: str) -> dict[str, str]:
    """Every file under ``path`` with the sha256 of its bytes (to prove a tool left its input alone)."""
    digests = {}
    for folder, _, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            with open(full, "rb") as f:
                digests[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def flip_byte(path: str, name: str, shard: int = 0, at: int = 0) -> str:
    """Corrupt byte ``at`` of a stored shard of tensor ``name``; returns the data file's name."""
    checkpoint = open_checkpoint(path)
    where = checkpoint.tensors[name].shards[shard].bytes
    file = checkpoint.manifest.files[where.file]
    with open(os.path.join(path, f"gen-{checkpoint.generation:08d}", file), "r+b") as f:
        f.seek(where.offset + at)
        byte = f.read(1)
        f.seek(where.offset + at)
        f.write(bytes([byte[0] ^ 0x40]))
    return file


def data_files(path: str) -> list[str]:
    """The data files of the newest committed generation of a checkpoint."""
    checkpoint = open_checkpoint(path)
    return [os.path.join(path, f"gen-{checkpoint.generation:08d}", f) for f in checkpoint.manifest.files]
