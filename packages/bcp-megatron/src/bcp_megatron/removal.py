"""Megatron's ``remove_sharded_tensors`` on a bcp checkpoint: the entries whose Megatron key starts
with a prefix are dropped, stored bytes included (Megatron-LM uses it to drop optimizer state).

As torch_dist's strategy, which drops every metadata key starting with the prefix, ShardedObjects go
too (matched by their unique key, ``<key>/shard_<offsets>_<shape>``), and a prefix that matches
nothing changes nothing and warns. ``bcp.remove_entries`` does the rewrite: the rest becomes a new
committed generation and the older generations are removed after that commit, so an interruption
leaves the checkpoint loadable, pruned or not.
"""

from __future__ import annotations

import os
import warnings

import bcp

from bcp_megatron.load import read_manifest
from bcp_megatron.shards import sharded_key


def remove_sharded(checkpoint_dir: "str | os.PathLike", key_prefix: str) -> None:
    """Remove the ShardedTensors and ShardedObjects whose key starts with ``key_prefix`` from the bcp
    checkpoint at ``checkpoint_dir`` (a path or a storage URL). One process, no collective: Megatron
    calls it on rank 0 alone. Rewrites what is kept (read and written back one shard at a time)."""
    manifest = read_manifest(checkpoint_dir)
    names = [name for name in (*manifest.tensors, *manifest.objects) if sharded_key(name).startswith(key_prefix)]
    if not names:
        warnings.warn(f"no sharded key of the checkpoint {os.fspath(checkpoint_dir)!r} begins with "
                      f"{key_prefix!r}: nothing removed")
        return
    bcp.remove_entries(checkpoint_dir, names)
