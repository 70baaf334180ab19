"""The contract every storage backend keeps, run unchanged on local, memory, S3 (a real SeaweedFS),
fsspec and HDFS.

HDFS runs through ``HdfsStorage`` over pyarrow's ``LocalFileSystem`` (no Hadoop here): the same code
as on a cluster, with ``rename(2)`` where the namenode renames. Its exclusive create holds on both,
for different reasons (see ``bcp.storage.hdfs``), so the concurrent-commit case runs here too; only a
live cluster (``BCP_TEST_HDFS_URL=hdfs://namenode:port/some/dir``) proves the namenode's side."""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np
import pytest
from bcp.storage import LocalStorage, MemoryStorage, S3Storage, Storage, storage_for
from bcp.storage.fsspec_storage import FsspecStorage
from bcp.storage.hdfs import HdfsStorage

# "fsspec" is the fallback for schemes without a backend of their own, here over fsspec's local files
BACKENDS = ["local", "memory", "s3", "fsspec", "hdfs-on-local-fs",
            pytest.param("hdfs-live", marks=pytest.mark.skipif(not os.environ.get("BCP_TEST_HDFS_URL"),
                                                                reason="BCP_TEST_HDFS_URL names no live HDFS"))]


@pytest.fixture(params=BACKENDS)
def storage(request, tmp_path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "root")
    if request.param == "memory":
        return MemoryStorage(f"memory://contract-{uuid.uuid4().hex[:8]}/root")
    if request.param == "hdfs-on-local-fs":
        from pyarrow.fs import LocalFileSystem

        return HdfsStorage(f"hdfs://stand-in{tmp_path}/root", filesystem=LocalFileSystem())
    if request.param == "hdfs-live":
        storage = storage_for(f"{os.environ['BCP_TEST_HDFS_URL'].rstrip('/')}/contract-{uuid.uuid4().hex[:8]}")
        assert isinstance(storage.inner, HdfsStorage)
        return storage
    if request.param == "fsspec":
        storage = storage_for(f"local://{tmp_path}/root")
        assert isinstance(storage.inner, FsspecStorage)  # reached through the registry's fallback
        return storage
    server = request.getfixturevalue("s3_server")
    return S3Storage(f"s3://ckpt/contract-{uuid.uuid4().hex[:8]}", **server.options())


def _pattern(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def test_a_written_file_reads_back_whole_and_sized(storage):
    storage.write_file("gen/a.bin", [memoryview(b"hello "), memoryview(b"world")])
    assert storage.read_bytes("gen/a.bin") == b"hello world"
    assert storage.size("gen/a.bin") == 11
    assert storage.exists("gen/a.bin") and storage.exists("gen") and storage.exists("")


def test_rewriting_a_file_replaces_it(storage):
    storage.write_file("a", [memoryview(b"first version")])
    storage.write_file("a", [memoryview(b"second")])
    assert storage.read_bytes("a") == b"second"


def test_ranged_reads_at_odd_offsets_return_exactly_those_bytes(storage):
    data = _pattern(100_003)
    storage.write_file("f.bin", [memoryview(data)])
    for offset, nbytes in [(0, 1), (1, 7), (4097, 12_345), (99_990, 13), (33_333, 0)]:
        dest = bytearray(nbytes)
        storage.read_into("f.bin", offset, memoryview(dest))
        assert bytes(dest) == data[offset:offset + nbytes]


def test_read_into_many_fills_consecutive_buffers_of_any_format(storage):
    data = _pattern(40_000, seed=1)
    storage.write_file("f.bin", [memoryview(data)])
    floats = np.zeros(1001, dtype=np.float32)  # a 4-byte-format view, as the reader passes tensors
    raw = bytearray(5)
    storage.read_into_many("f.bin", 333, [memoryview(floats), memoryview(raw), memoryview(bytearray(0))])
    assert floats.tobytes() == data[333:333 + 4004] and bytes(raw) == data[4337:4342]


def test_reading_past_the_end_is_an_eof_error(storage):
    storage.write_file("short", [memoryview(b"0123456789")])
    with pytest.raises(EOFError):
        storage.read_into("short", 5, memoryview(bytearray(10)))
    with pytest.raises(EOFError):
        storage.read_into("short", 50, memoryview(bytearray(1)))


def test_empty_files_exist_with_size_zero(storage):
    storage.write_file("empty", [])
    storage.write_file("empty2", [memoryview(b"")])
    assert storage.read_bytes("empty") == b"" and storage.read_bytes("empty2") == b""
    assert storage.size("empty") == 0 and storage.exists("empty")


def test_a_large_file_travels_in_parts_and_reads_back_at_any_range(storage):
    data = _pattern(40 << 20, seed=2)  # > 2 parts of 16 MiB: a multipart upload on S3
    view = memoryview(data)
    storage.write_file("big.bin", [view[:1 << 20], view[1 << 20:]])
    assert storage.size("big.bin") == len(data)
    dest = bytearray(20 << 20)
    storage.read_into("big.bin", (10 << 20) + 3, memoryview(dest))
    assert dest == data[(10 << 20) + 3:(30 << 20) + 3]


def test_missing_files_raise_file_not_found(storage):
    assert not storage.exists("nothing") and not storage.exists("no/such/dir")
    for call in (lambda: storage.read_bytes("nothing"), lambda: storage.size("nothing"),
                 lambda: storage.read_into("nothing", 0, memoryview(bytearray(1)))):
        with pytest.raises(FileNotFoundError):
            call()


def test_list_dir_names_immediate_children_sorted(storage):
    for name in ("run/gen-00000002/data/0.bin", "run/gen-00000001/COMMITTED", "run/notes", "other/x"):
        storage.write_file(name, [memoryview(b"x")])
    assert storage.list_dir("run") == ["gen-00000001", "gen-00000002", "notes"]
    assert storage.list_dir("") == ["other", "run"]
    assert storage.list_dir("run/gen-00000002") == ["data"]
    assert storage.list_dir("absent") == []


def test_delete_tree_removes_a_prefix_and_nothing_beside_it(storage):
    for name in ("run/gen-1/a", "run/gen-1/sub/b", "run/gen-10/c", "run/gen-2/d"):
        storage.write_file(name, [memoryview(b"x")])
    storage.delete_tree("run/gen-1")
    assert storage.list_dir("run") == ["gen-10", "gen-2"]
    assert not storage.exists("run/gen-1/a") and storage.exists("run/gen-10/c")
    storage.delete_tree("run/absent")  # absent is not an error
    storage.delete_tree("")
    assert storage.list_dir("") == [] and not storage.exists("")


def test_put_if_absent_creates_once(storage):
    assert storage.put_if_absent("gen/COMMITTED", b"first")
    assert not storage.put_if_absent("gen/COMMITTED", b"second")
    assert storage.read_bytes("gen/COMMITTED") == b"first"


def test_concurrent_put_if_absent_has_exactly_one_winner(storage):
    barrier = threading.Barrier(8)
    won: list[int] = []
    errors: list[BaseException] = []

    def contend(i: int) -> None:
        barrier.wait()
        try:
            if storage.put_if_absent("COMMITTED", f"writer {i}".encode()):
                won.append(i)
        except BaseException as exc:  # noqa: BLE001 (a thread's failure must fail the test, not only warn)
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(won) == 1
    assert storage.read_bytes("COMMITTED") == f"writer {won[0]}".encode()
