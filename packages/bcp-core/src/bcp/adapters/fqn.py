"""Canonical names: fully qualified names with wrapper prefixes removed, so state moves between
wrappers (DDP, FSDP1, torch.compile, activation checkpointing) and layouts."""

from __future__ import annotations

from typing import Iterable

from bcp.errors import MismatchError

WRAPPER_PREFIXES = ("module", "_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")


def canonical(name: str) -> str:
    if not any(prefix in name for prefix in WRAPPER_PREFIXES):  # most names: no wrapper to remove
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PREFIXES)


def canonical_map(names: Iterable[str]) -> dict[str, str]:
    """canonical name -> original name; two originals with one canonical name is an error."""
    mapping: dict[str, str] = {}
    for name in names:
        key = canonical(name)
        if key in mapping and mapping[key] != name:
            raise MismatchError(f"{mapping[key]!r} and {name!r} have the same canonical name", key=key)
        mapping[key] = name
    return mapping
