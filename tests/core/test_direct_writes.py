"""Direct I/O in the writer process of asynchronous saves: each large piece lies in its data file at
the same place modulo a page as in the shared staging memory, so that the disk reads its aligned
bulk straight from that memory (``LocalStorage.write_file_direct``, ``O_DIRECT``), the rest going
through the page cache; small pieces stay back to back in their files (loads read them together).
The files hold the values of the call, bit for bit; a flipped byte is caught on load; a write that
fails part way commits nothing and leaves the previous checkpoint loading; where the file system
refuses direct I/O (ramfs, mounted for real in a private mount namespace) everything goes through
the page cache with the same result. All on real files; no fault is simulated."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import bcp
from bcp.engine.shared_memory import shared_memory_available
from bcp.integration import runtime
from bcp.storage import LocalStorage
from bcp.storage.local import DIRECT_MIN_BYTES
from bcp.tools import verify_checkpoint
from models import read_manifest

pytestmark = pytest.mark.skipif(not (shared_memory_available() and hasattr(os, "O_DIRECT")),
                                reason="no shared memory by descriptor or no direct I/O here")

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _released():
    yield
    bcp.shutdown()


def _page_cached_fraction(path) -> float:
    """How much of the file is in the page cache (``mincore`` over a mapping of it)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # writable: ctypes needs that for an address
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector) == 0
    finally:
        del anchor
        mapping.close()
    return sum(v & 1 for v in vector) / pages


def _direct_io_skips_the_page_cache(folder) -> bool:
    """Whether direct writes under ``folder`` bypass the page cache (not so on tmpfs, which takes
    them as ordinary writes)."""
    memory = mmap.mmap(-1, 2 * MIB)
    LocalStorage(folder).write_file_direct("probe", [memoryview(memory)])
    try:
        return _page_cached_fraction(os.path.join(folder, "probe")) < 0.5
    finally:
        os.unlink(os.path.join(folder, "probe"))


def _aligned_memory(nbytes: int, seed: int) -> memoryview:
    memory = mmap.mmap(-1, nbytes)
    memory[:] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    return memoryview(memory)


def _chunk_shapes(memory: memoryview) -> list[memoryview]:
    """Chunks of every kind: aligned and unaligned starts and ends, read-only bytes, empty, and a
    run that is contiguous in memory with the chunk before it."""
    return [memoryview(b"header"), memory[6: 6 + 3 * MIB + 7], memory[6 + 3 * MIB + 7: 5 * MIB],
            memoryview(bytes(41)), memory[5 * MIB: 5 * MIB], memory[5 * MIB + 13: 7 * MIB + 4096],
            memoryview(bytes(range(200))), memory[100: 2 * MIB]]


def test_direct_writes_hold_the_bytes_given_and_skip_the_page_cache(tmp_path):
    memory = _aligned_memory(8 * MIB, seed=1)
    chunks = _chunk_shapes(memory)
    storage = LocalStorage(tmp_path)
    storage.write_file_direct("data/a.bin", chunks)
    expected = b"".join(bytes(c) for c in chunks)
    assert (tmp_path / "data" / "a.bin").read_bytes() == expected
    if not _direct_io_skips_the_page_cache(tmp_path):
        pytest.skip("this file system takes direct writes into its page cache")
    storage.write_file_direct("data/b.bin", [memory])  # one aligned run: all of it by direct I/O
    assert _page_cached_fraction(tmp_path / "data" / "b.bin") < 0.05
    assert (tmp_path / "data" / "b.bin").read_bytes() == bytes(memory)


def _state(seed: int) -> dict:
    """About 70 MB (two data files in the writer process) of odd sizes and several dtypes, so that
    the staging's padding and the files' unaligned ends all occur, and a value beside them."""
    generator = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(9 * MIB + 3, generator=generator),
            "half": torch.randn(5 * MIB + 1, generator=generator).to(torch.bfloat16),
            "wide": torch.randn(2 * MIB + 5, generator=generator, dtype=torch.float64),
            "flags": torch.rand(4097, generator=generator) > 0.5,
            "ids": torch.randint(-9, 9, (3 * MIB + 11,), generator=generator),
            "small": torch.randn(17, generator=generator),
            "step": seed}


def _loaded(path) -> dict:
    out = {name: torch.empty_like(t) if isinstance(t, torch.Tensor) else None for name, t in _state(0).items()}
    bcp.load(path, {"model": out})
    return out


def _equal(loaded: dict, expected: dict) -> bool:
    return all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype if isinstance(v, torch.Tensor)
               else loaded[k] == v for k, v in expected.items())


def test_an_async_save_by_direct_io_holds_the_values_of_the_call(tmp_path):
    if not _direct_io_skips_the_page_cache(tmp_path):
        pytest.skip("this file system takes direct writes into its page cache: nothing would show direct I/O")
    state = _state(seed=2)
    handle = bcp.save(tmp_path, {"model": state}, async_save=True)
    for value in state.values():  # training changes every tensor right after the call
        if isinstance(value, torch.Tensor):
            value.zero_() if value.dtype == torch.bool else value.fill_(-3)
    handle.wait()
    assert runtime().background.writer_pid() is not None  # the writer process wrote it
    manifest = read_manifest(tmp_path)
    files = [tmp_path / "gen-00000001" / name for name in manifest.files]
    assert len(files) >= 2
    assert max(_page_cached_fraction(f) for f in files) < 0.2  # their bulk went by direct I/O
    assert _equal(_loaded(tmp_path), _state(seed=2))
    report = verify_checkpoint(tmp_path)
    assert report.ok, report.problems  # no byte after the last stored range, every checksum right


def test_small_pieces_stay_back_to_back_beside_the_pieces_placed_for_direct_io(tmp_path):
    state = {**_state(seed=6), **{f"bias{i}": torch.randn(7 + i) for i in range(40)}}
    bcp.save(tmp_path, {"model": state}, async_save=True).wait()
    manifest = read_manifest(tmp_path)
    by_file: dict[int, list] = {}
    for name, entry in manifest.tensors.items():
        for shard in entry.shards:
            by_file.setdefault(shard.bytes.file, []).append(shard.bytes)
    small_after_another = 0
    for ranges in by_file.values():
        ranges.sort(key=lambda r: r.offset)
        for before, after in zip(ranges, ranges[1:]):
            if after.nbytes < DIRECT_MIN_BYTES:  # only a piece placed for direct I/O may have zeros before it
                assert after.offset == before.offset + before.nbytes
                small_after_another += 1
    assert small_after_another >= 30
    out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    bcp.load(tmp_path, {"model": out})
    assert _equal(out, {**_state(seed=6), **{k: v for k, v in state.items() if k.startswith("bias")}})


def test_a_flipped_byte_in_a_directly_written_file_is_caught(tmp_path):
    bcp.save(tmp_path, {"model": _state(seed=3)}, async_save=True).wait()
    manifest = read_manifest(tmp_path)
    stored = manifest.tensors["model/big"].shards[0].bytes
    victim = tmp_path / "gen-00000001" / manifest.files[stored.file]
    with open(victim, "r+b") as f:  # a byte in the middle of the page-aligned bulk
        f.seek(stored.offset + 4 * MIB + 1)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x04]))
    with pytest.raises(bcp.CorruptCheckpointError, match="checksum mismatch.*'model/big'"):
        _loaded(tmp_path)


def test_a_direct_write_cut_short_by_a_file_size_limit_commits_nothing(tmp_path):
    """The writer process gets a real limit on the size of the files it writes (``RLIMIT_FSIZE``):
    its direct writes stop part way (short, then ``EFBIG``) as on a full disk."""
    bcp.save(tmp_path, {"model": _state(seed=4)}, async_save=True).wait()
    pid = runtime().background.writer_pid()
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (16 * MIB + 4096, resource.RLIM_INFINITY))
    with pytest.raises(bcp.StorageError, match="File too large"):
        bcp.save(tmp_path, {"model": _state(seed=5)}, async_save=True).wait()
    assert not (tmp_path / "gen-00000002").exists()  # the failed generation removed whole
    assert _equal(_loaded(tmp_path), _state(seed=4))  # the previous checkpoint is still the latest
    assert runtime().background.writer_pid() == pid  # the writer process survived its failed job


_ON_RAMFS = textwrap.dedent("""
    import os, sys, torch, bcp
    from bcp.storage import LocalStorage
    from bcp.integration import runtime
    folder = sys.argv[1]
    try:
        os.close(os.open(os.path.join(folder, "probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        sys.exit("ramfs took O_DIRECT: nothing here tests the refusal")
    except OSError:
        os.unlink(os.path.join(folder, "probe"))
    state = {"w": torch.randn(9 << 20), "b": torch.arange(1001)}
    expected = {k: v.clone() for k, v in state.items()}
    handle = bcp.save(folder, {"model": state}, async_save=True)
    for v in state.values():
        v.zero_()
    handle.wait()
    assert runtime().background.writer_pid() is not None
    out = {k: torch.empty_like(v) for k, v in expected.items()}
    bcp.load(folder, {"model": out})
    assert all(torch.equal(out[k], v) for k, v in expected.items())
    print("refused, written through the page cache, loaded equal")
""")


def test_where_the_file_system_refuses_direct_io_the_page_cache_writes_everything(tmp_path):
    mount_point = tmp_path / "ramfs"
    mount_point.mkdir()
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("mounting a ramfs needs root and unshare (a private mount namespace)")
    script = 'mount -t ramfs ramfs "$2" && exec "$0" -c "$1" "$2"'
    run = subprocess.run([unshare, "--mount", "--propagation", "private", "sh", "-c", script,
                          sys.executable, _ON_RAMFS, str(mount_point)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if "mount:" in run.stderr and run.returncode != 0:
        pytest.skip(f"no ramfs mount here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    assert "refused, written through the page cache, loaded equal" in run.stdout
