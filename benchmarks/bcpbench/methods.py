"""The checkpointers compared, behind one small interface: ``save(path, state)`` writes a flat
dict of tensors (plain or DTensor) durably, ``load(path, dest)`` fills the preallocated ``dest``
and returns it.

Every saver leaves its files fsync'd, so the save times are comparable with the raw floor.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import bcp
import torch

from bcpbench import disk

Tensors = dict[str, torch.Tensor]
FIRST_SAVE = "bcp, first save of the structure"  # a bcp save on a channel with no cached plan


class Bcp:
    """``bcp.save`` / ``bcp.load`` of ``{"model": state}``; ``coordinator`` picks the ranks (and,
    through its channel, the plan cache entry); ``compression`` names the codec saves use (None:
    bcp's default)."""

    def __init__(self, name: str = "bcp", coordinator: Callable[[], Any] | None = None,
                 io_threads: int = 4, verify: bool = True, read_once: bool = False,
                 transactional: bool = True, metrics_log: bool = False, compression: str | None = None) -> None:
        self.name = name
        self._coordinator = coordinator or (lambda: None)
        self.io_threads = io_threads
        self.verify = verify
        self.read_once = read_once
        self.transactional = transactional
        self.metrics_log = metrics_log
        self.compressed = {} if compression is None else {"compression": compression}
        self.last_save: bcp.PhaseStats | None = None
        self.last_load: bcp.PhaseStats | None = None

    def save(self, path: str, state: Tensors) -> None:
        handle = bcp.save(path, {"model": state}, coordinator=self._coordinator(), io_threads=self.io_threads,
                          **self.compressed)
        self.last_save = handle.stats

    def save_async(self, path: str, state: Tensors) -> bcp.SaveHandle:
        return bcp.save(path, {"model": state}, async_save=True, coordinator=self._coordinator(),
                        io_threads=self.io_threads, metrics_log=self.metrics_log)

    def load(self, path: str, dest: Tensors) -> Tensors:
        result = bcp.load(path, {"model": dest}, coordinator=self._coordinator(), io_threads=self.io_threads,
                          verify=self.verify, read_once=self.read_once, transactional=self.transactional)
        self.last_load = result.stats
        return dest


class PlanChannel(bcp.SingleProcessCoordinator):
    """A single-process coordinator with a plan-cache entry of its own (bcp caches one plan per
    coordinator channel): two structures saved alternately each keep their cached plan, and a
    channel never used before plans anew, as the first save of a structure does."""

    _fresh = itertools.count()

    def __init__(self, key: object) -> None:
        self.key = key

    def cache_key(self) -> object:
        return ("bench-channel", self.key)

    @classmethod
    def fresh(cls) -> PlanChannel:
        return cls(("fresh", next(cls._fresh)))


class Dcp:
    """``torch.distributed.checkpoint`` with its file system writer (``thread_count`` writer
    threads; 1 is DCP's default) and reader. ``single_rank`` loads on one rank of a group. ``zstd``
    adds DCP's experimental zstd stream extension (``_extension.ZStandard``: each file's stream
    through ``zstandard``'s stream writer at its default level, 3), which its reader undoes."""

    def __init__(self, threads: int = 1, single_rank: bool = False, zstd: bool = False) -> None:
        self.threads = threads
        self.name = ("DCP" if threads == 1 else f"DCP thread_count={threads}") + (", zstd extension" if zstd else "")
        self.single_rank = single_rank
        self.zstd = zstd

    def save(self, path: str, state: Tensors) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._extension import ZStandard

        writer = dcp.FileSystemWriter(path, thread_count=self.threads, _extensions=[ZStandard()] if self.zstd else None)
        dcp.save({"model": state}, storage_writer=writer)

    def load(self, path: str, dest: Tensors) -> Tensors:
        import torch.distributed.checkpoint as dcp

        dcp.load({"model": dest}, storage_reader=dcp.FileSystemReader(path), no_dist=self.single_rank)
        return dest


class DcpAsync:
    """``dcp.async_save`` with the file system writer staging a fresh host copy per save (DCP's
    default), or with one ``DefaultStager`` kept across saves, which reuses its host copies (on a
    CPU-only machine; DCP's ``cache_staged_state_dict`` writer option needs an accelerator)."""

    def __init__(self, reuse_stager: bool) -> None:
        self.name = "DCP async_save" + (", reused stager" if reuse_stager else "")
        self._stager: Any = None
        if reuse_stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))

    def save_async(self, path: str, state: Tensors, process: bool = False) -> Future:
        """With ``process``, DCP's writer process (``AsyncCheckpointerType.PROCESS``) writes, which
        needs a process group (one of a single rank will do)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        return dcp.async_save({"model": state}, storage_writer=dcp.FileSystemWriter(path),
                              async_stager=self._stager, async_checkpointer_type=kind)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()


class TorchSave:
    """``torch.save`` of the dict into one file, then fsync; ``torch.load``, then a copy into the
    live tensors (what ``load_state_dict`` does with them)."""

    name = "torch.save"

    def save(self, path: str, state: Tensors) -> None:
        os.makedirs(path, exist_ok=True)
        torch.save(state, os.path.join(path, "state.pt"))
        disk.fsync_tree(path)

    def load(self, path: str, dest: Tensors) -> Tensors:
        copy_into(dest, torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=True))
        return dest


class Safetensors:
    """``safetensors.torch.save_file`` into one file, then fsync; ``load_file`` (a memory map of the
    file), then a copy into the live tensors, which is when the bytes are actually read."""

    name = "safetensors"

    def save(self, path: str, state: Tensors) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        save_file(state, os.path.join(path, "state.safetensors"))
        disk.fsync_tree(path)

    def load(self, path: str, dest: Tensors) -> Tensors:
        from safetensors.torch import load_file

        copy_into(dest, load_file(os.path.join(path, "state.safetensors")))
        return dest


class RawFiles:
    """The disk's own floor: the state's bytes written as-is into ``threads`` files (fsync'd), and
    files read back as-is into one preallocated block. ``prefix`` names this rank's files."""

    def __init__(self, threads: int, prefix: str = "raw") -> None:
        self.threads = threads
        self.name = f"raw write/read, {threads} thread{'s' if threads > 1 else ''}"
        self.prefix = prefix

    def save(self, path: str, state: Tensors) -> None:
        disk.raw_write(path, [_local(t) for t in state.values()], self.threads, self.prefix)

    def read(self, path: str, into: torch.Tensor, every_rank: bool = False) -> None:
        """Read this rank's files (or every rank's) into ``into``."""
        disk.raw_read(disk.files_under(path, "" if every_rank else self.prefix), into, self.threads)


def copy_into(dest: Tensors, state: Tensors) -> None:
    """The floor of staging and of a warm load: a bare copy of the state into reused buffers."""
    for name, tensor in state.items():
        _local(dest[name]).copy_(_local(tensor))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
