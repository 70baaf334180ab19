"""Object-store names: keys under a prefix, the children of a prefix, and scattering fetched bytes
into the caller's buffers. Shared by the backends that have no directories (memory, S3)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def split_url(url: str, scheme: str, first: str) -> tuple[str, str]:
    """``scheme://first/prefix`` as ``(first, prefix)``; ``first`` (a bucket, a namespace) is required."""
    if not url.startswith(f"{scheme}://"):
        raise ValueError(f"not a {scheme}:// URL: {url!r}")
    head, _, prefix = url[len(scheme) + 3:].partition("/")
    if not head:
        raise ValueError(f"{scheme}:// URL without a {first}: {url!r}")
    return head, prefix.strip("/")


def join_key(prefix: str, name: str) -> str:
    """``prefix/name`` with no empty parts (either may be ``""``)."""
    return "/".join(part for part in (prefix.strip("/"), name.strip("/")) if part)


def is_under(key: str, prefix: str) -> bool:
    """Whether ``key`` lies strictly below the "directory" ``prefix`` (everything is below ``""``)."""
    return key.startswith(f"{prefix}/") if prefix else bool(key)


def child_names(keys: Iterable[str], prefix: str) -> list[str]:
    """The immediate children of ``prefix`` among ``keys``: file names and sub-prefix names, sorted."""
    start = len(prefix) + 1 if prefix else 0
    return sorted({key[start:].split("/", 1)[0] for key in keys if is_under(key, prefix)})


def flat_bytes(view: memoryview) -> memoryview:
    """``view`` as one-dimensional unsigned bytes (a tensor's view may have another format or shape)."""
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def scatter(sources: Sequence[memoryview], dests: Sequence[memoryview]) -> None:
    """Copy the consecutive bytes of ``sources`` (fetched parts) into ``dests`` one after the other,
    without first joining the parts (a join would copy every byte once more)."""
    parts = iter(sources)
    source = memoryview(b"")
    for dest in dests:
        flat = flat_bytes(dest)
        filled = 0
        while filled < flat.nbytes:
            if not source.nbytes:
                source = flat_bytes(memoryview(next(parts)))
            step = min(source.nbytes, flat.nbytes - filled)
            flat[filled:filled + step] = source[:step]
            source = source[step:]
            filled += step
