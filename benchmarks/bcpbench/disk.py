"""The disk's own floors and page-cache control: fsync'd raw writes from tensor memory, raw reads
into preallocated memory, and eviction of files from the page cache for cold reads."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import torch

from bcp.engine.bytes_of import byte_view

IO_CHUNK = 64 << 20  # bytes per os.write / preadv call: large enough to stream, bounded for the kernel


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, tensors: list[torch.Tensor]) -> None:
    """Write the tensors' bytes back to back into ``path`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in tensors:
            view = byte_view(tensor.contiguous())
            while view.nbytes:
                view = view[os.write(fd, view[:IO_CHUNK]):]
        os.fsync(fd)
    finally:
        os.close(fd)


def balanced_bins(tensors: list[torch.Tensor], count: int) -> list[list[torch.Tensor]]:
    """Largest first into the emptiest bin: ``count`` files that take about as long to write."""
    bins: list[list[torch.Tensor]] = [[] for _ in range(count)]
    sizes = [0] * count
    for tensor in sorted(tensors, key=lambda t: -t.numel() * t.element_size()):
        i = sizes.index(min(sizes))
        bins[i].append(tensor)
        sizes[i] += tensor.numel() * tensor.element_size()
    return [b for b in bins if b]


def raw_write(directory: str, tensors: list[torch.Tensor], threads: int, prefix: str = "raw") -> None:
    """The floor of a save: the same bytes in ``threads`` files written in parallel, fsync'd."""
    os.makedirs(directory, exist_ok=True)
    bins = balanced_bins(tensors, threads)
    with ThreadPoolExecutor(max_workers=len(bins)) as pool:
        list(pool.map(lambda ib: write_file(os.path.join(directory, f"{prefix}-{ib[0]}.bin"), ib[1]),
                      enumerate(bins)))
    fsync_dir(directory)


def files_under(directory: str, prefix: str = "") -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(directory)
                  for name in names if name.startswith(prefix))


def read_file(path: str, dest: memoryview) -> None:
    read_file_into(path, [dest])


def read_file_into(path: str, dests: list[memoryview]) -> None:
    """Read ``path`` from its start into ``dests``, one after another."""
    fd = os.open(path, os.O_RDONLY)
    try:
        start = 0
        for dest in dests:
            offset = 0
            while offset < dest.nbytes:
                got = os.preadv(fd, [dest[offset: offset + IO_CHUNK]], start + offset)
                if got == 0:
                    raise EOFError(f"{path} ends at byte {start + offset}, {start + dest.nbytes} expected")
                offset += got
            start += dest.nbytes
    finally:
        os.close(fd)


def raw_read(paths: list[str], dest: torch.Tensor, threads: int) -> int:
    """The floor of a load: read whole files into ``dest``'s memory back to back, one thread per
    file, ``threads`` at a time. Returns the bytes read."""
    sizes = [os.path.getsize(p) for p in paths]
    view = byte_view(dest)
    if sum(sizes) > view.nbytes:
        raise ValueError(f"{sum(sizes)} bytes of files do not fit a {view.nbytes}-byte buffer")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths)))) as pool:
        list(pool.map(lambda i: read_file(paths[i], view[starts[i]: starts[i] + sizes[i]]), range(len(paths))))
    return sum(sizes)


def read_files_into(paths: list[str], dests: list[list[memoryview]]) -> None:
    """Read each file, from its start, into its list of buffers one after another: one thread per
    file, all at once (the floor of a load into live tensors of their own storage)."""
    with ThreadPoolExecutor(max_workers=max(1, len(paths))) as pool:
        list(pool.map(read_file_into, paths, dests))


def fsync_tree(directory: str, evict: bool = False) -> None:
    """fsync every file under ``directory`` (and the directory); with ``evict``, also drop them
    from the page cache so the next read comes from the disk (only clean pages can be dropped,
    hence the fsync first)."""
    for path in files_under(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if evict:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    fsync_dir(directory)


def evict(directory: str) -> None:
    fsync_tree(directory, evict=True)


def remove(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def free_bytes(directory: str) -> int:
    return shutil.disk_usage(directory).free
