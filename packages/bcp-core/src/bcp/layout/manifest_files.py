"""The data files a manifest lists, read from its bytes without checking the rest of it: what
retention and a memory tier's census need of manifests they do not load (a load parses and checks
the whole manifest, ``Manifest.decode``)."""

from __future__ import annotations

import json

from bcp.layout.manifest import EARLIER_FILES_VERSION
from bcp.layout.references import referred_generations


def listed_files(data: bytes) -> list[str] | None:
    """The names in the manifest's ``files``; None where ``data`` is not a manifest that lists them."""
    return _files(_document(data))


def earlier_generations(data: bytes, generation: int) -> set[int]:
    """The generations before ``generation`` whose data files the manifest of ``generation`` lists
    (only manifests of format version ``EARLIER_FILES_VERSION`` on list any); none where ``data``
    is not a manifest."""
    doc = _document(data)
    version = doc.get("version") if doc is not None else None
    files = _files(doc) if type(version) is int and version >= EARLIER_FILES_VERSION else None
    return {g for g in referred_generations(files or ()) if g < generation}


def _document(data: bytes) -> dict | None:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _files(doc: dict | None) -> list[str] | None:
    files = doc.get("files") if doc is not None else None
    return [name for name in files if isinstance(name, str)] if isinstance(files, list) else None
