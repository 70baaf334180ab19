"""The one place that maps a checkpoint URL to its storage backend.

Backends register a factory under their URL scheme (``register_backend("s3", S3Storage)``); the
engine only ever sees the ``Storage`` the factory returns. A plain path (no ``scheme://``) is local;
a scheme no backend registered, but fsspec knows, goes through fsspec (retried on transport errors).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from bcp.storage.base import Storage
from bcp.storage.local import LocalStorage

Factory = Callable[[str], Storage]
_factories: dict[str, Factory] = {}


def register_backend(scheme: str, factory: Factory) -> None:
    """Make ``scheme://...`` URLs open with ``factory(url)``; a later registration replaces an earlier one."""
    _factories[scheme.lower()] = factory


def registered_schemes() -> list[str]:
    return sorted(_factories)


def is_url(path: str | os.PathLike) -> bool:
    """Whether a checkpoint path is a URL (``scheme://...``, ``file://`` included) rather than a
    plain local path."""
    return "://" in os.fspath(path)


def storage_for(path: str | os.PathLike | Storage) -> Storage:
    """The backend for a checkpoint path or URL. A ``Storage`` instance is used as is; a plain path is
    a local directory; ``scheme://...`` goes to the factory registered for ``scheme``."""
    if isinstance(path, Storage):
        return path
    text = os.fspath(path)
    if not is_url(text):
        return LocalStorage(text)
    scheme = text.split("://", 1)[0].lower()
    factory = _factories.get(scheme)
    if factory is not None:
        return factory(text)
    if _fsspec_knows(scheme):
        from bcp.storage.fsspec_storage import FsspecStorage
        from bcp.storage.retry import RetryingStorage

        return RetryingStorage(FsspecStorage(text))
    raise ValueError(f"no storage backend for scheme {scheme!r} in {text!r} "
                     f"(registered: {', '.join(registered_schemes())}; fsspec knows none by that name)")


def _fsspec_knows(scheme: str) -> bool:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False
    return scheme in known_implementations or scheme in registry
