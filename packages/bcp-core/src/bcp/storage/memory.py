"""Process-local in-memory storage: ``memory://name/prefix``, for tests and fast in-job snapshots."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from bcp.storage.base import Storage
from bcp.storage.names import child_names, is_under, join_key, scatter, split_url


class _Namespace:
    """One ``memory://name``: object keys to immutable bytes, guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, bytes] = {}


_namespaces: dict[str, _Namespace] = {}
_namespaces_lock = threading.Lock()


def _namespace(name: str) -> _Namespace:
    with _namespaces_lock:
        return _namespaces.setdefault(name, _Namespace())


class MemoryStorage(Storage):
    """Objects in this process's memory under ``memory://<namespace>/<prefix>``. Every instance naming
    the same namespace sees the same objects; nothing is shared with other processes. A file becomes
    visible whole when ``write_file`` returns (like an object store's completed upload)."""

    def __init__(self, url: str) -> None:
        namespace, self._prefix = split_url(url, "memory", "namespace")
        _refuse_several_processes(url)
        self.root = url.rstrip("/")
        self._space = _namespace(namespace)

    def _key(self, name: str) -> str:
        return join_key(self._prefix, name)

    def _get(self, name: str) -> bytes:
        with self._space.lock:
            data = self._space.objects.get(self._key(name))
        if data is None:
            raise FileNotFoundError(2, "no such object", f"{self.root}/{name}")
        return data

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        data = b"".join(chunks)
        with self._space.lock:
            self._space.objects[self._key(name)] = data

    def put_if_absent(self, name: str, data: bytes) -> bool:
        key = self._key(name)
        with self._space.lock:
            if key in self._space.objects:
                return False
            self._space.objects[key] = bytes(data)
            return True

    def read_into(self, name: str, offset: int, dest: memoryview) -> None:
        self.read_into_many(name, offset, [dest])

    def read_into_many(self, name: str, offset: int, dests: Sequence[memoryview]) -> None:
        data = memoryview(self._get(name))
        end = offset + sum(d.nbytes for d in dests)
        if end > len(data):
            raise EOFError(f"{self.root}/{name}: object ends at byte {len(data)}, before byte {end}")
        scatter([data[offset:end]], dests)

    def read_bytes(self, name: str) -> bytes:
        return self._get(name)

    def exists(self, name: str) -> bool:
        key = self._key(name)
        with self._space.lock:
            return any(k == key or is_under(k, key) for k in self._space.objects)

    def size(self, name: str) -> int:
        return len(self._get(name))

    def list_dir(self, prefix: str) -> list[str]:
        with self._space.lock:
            keys = list(self._space.objects)
        return child_names(keys, self._key(prefix))

    def delete_tree(self, prefix: str) -> None:
        key = self._key(prefix)
        with self._space.lock:
            for k in [k for k in self._space.objects if k == key or is_under(k, key)]:
                del self._space.objects[k]


def _refuse_several_processes(url: str) -> None:
    """Each rank's memory is its own: a save on several ranks would commit a manifest naming files
    that rank 0 cannot see, so that is refused up front rather than found at load."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{url}: memory:// storage is process-local and cannot hold a checkpoint of "
                         f"{dist.get_world_size()} ranks; use a shared file system or an object store")
