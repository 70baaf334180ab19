"""Canonical names: fully qualified names with wrapper prefixes removed, so state moves between
wrappers (DDP, FSDP1, torch.compile, activation checkpointing) and layouts."""

from __future__ import annotations

from typing import Iterable

from bcp.errors import MismatchError

WRAPPER_PREFIXES = ("module", "_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")


def canonical(name: str) -> str:
    # Every wrapper prefix contains "module" or "_orig_mod": most names have neither, nothing to remove.
    if "module" not in name and "_orig_mod" not in name:
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
