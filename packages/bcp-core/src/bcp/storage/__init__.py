"""Storage backends: bytes in and out, knowing nothing of tensors, named by URL.

``storage_for(url)`` picks the backend by scheme: a plain path or ``file://`` is a local directory,
``memory://name/...`` lives in this process, ``s3://bucket/prefix`` is S3 or an S3-compatible store
(retried, see :mod:`bcp.storage.retry`), ``hdfs://namenode:port/path`` is HDFS through pyarrow. More schemes plug in with :func:`register_backend`.
"""

from __future__ import annotations

from bcp.storage.base import Storage
from bcp.storage.hdfs import HdfsStorage
from bcp.storage.local import LocalStorage
from bcp.storage.memory import MemoryStorage
from bcp.storage.registry import is_url, register_backend, registered_schemes, storage_for
from bcp.storage.retry import RetryingStorage, RetryPolicy, RetryStats
from bcp.storage.s3 import S3Storage

__all__ = [
           "HdfsStorage",
           "LocalStorage",
           "MemoryStorage",
           "RetryPolicy",
           "RetryStats",
           "RetryingStorage",
           "S3Storage",
           "Storage",
           "register_backend",
           "registered_schemes",
           "storage_for", "is_url",
]

register_backend("file", lambda url: LocalStorage(url[len("file://"):]))
register_backend("memory", MemoryStorage)
register_backend("s3", S3Storage)
register_backend("hdfs", lambda url: RetryingStorage(HdfsStorage(url)))  # connection errors retried
