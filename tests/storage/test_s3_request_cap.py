"""The cap on requests one process keeps in flight to one S3 store, shared by every storage of the
store and every thread, counted at a loopback proxy in front of the real SeaweedFS server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from bcp.storage import S3Storage
from s3_fault_proxy import FaultProxy
from s3_part_uploads import PART, seven_part_file


def test_parts_and_reads_of_several_files_from_several_threads_stay_within_the_stores_cap(s3_server, s3_url):
    proxy = FaultProxy(s3_server.endpoint)
    try:
        # two storages of one store (same settings): they share the process's cap of 3
        storages = [S3Storage(f"{s3_url}/{i}", part_bytes=PART, max_requests=3, **s3_server.options(proxy.endpoint))
                    for i in range(2)]
        data, views = seven_part_file()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: storages[i % 2].write_file(f"file-{i}", views), range(4)))
            assert proxy.max_in_flight == 3, proxy.max_in_flight  # reached, never passed

            proxy.reset_counts()
            reads = list(pool.map(lambda i: storages[i % 2].read_bytes(f"file-{i}"), range(4)))
            ranged = list(pool.map(lambda i: _read_all(storages[i % 2], f"file-{i}", len(data)), range(4)))
    finally:
        proxy.close()
    assert reads == [data] * 4 and ranged == [data] * 4
    assert 2 <= proxy.max_in_flight <= 3, proxy.max_in_flight


def _read_all(storage: S3Storage, name: str, nbytes: int) -> bytes:
    """A ranged read of the whole file: two 16 MiB ranges fetched in parallel by one call."""
    out = bytearray(nbytes)
    storage.read_into(name, 0, memoryview(out))
    return bytes(out)
