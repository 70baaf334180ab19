"""Rules the tools apply to entries: which to drop, how to rename them, which dtype to cast to.

Patterns (``drop`` globs, cast globs) match the source names; renames run last, so a rule set
reads the same whatever it renames. Globs are ``fnmatch`` patterns where ``*`` also crosses
``/`` and ``.``; renames are regular expressions applied with ``re.sub`` in order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Iterable

import torch

from bcp.errors import MismatchError
from bcp.layout.dtypes import dtype_from_name

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64"}


def parse_dtype(text: str) -> torch.dtype:
    """A floating-point dtype by name: ``bfloat16``/``bf16``, ``float16``/``fp16``, ``float32``, ..."""
    name = _DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    try:
        dtype = dtype_from_name(name)
    except KeyError:
        raise ValueError(f"unknown dtype {text!r} (use e.g. bfloat16, float16, float32)") from None
    if not dtype.is_floating_point:
        raise ValueError(f"only floating-point dtypes are cast targets, got {text!r}")
    return dtype


@dataclass(frozen=True)
class NameRules:
    """Entries matching a ``drop`` glob are left out; ``rename`` pairs (regex, replacement) then
    rewrite the names of the others."""

    drop: tuple[str, ...] = ()
    rename: tuple[tuple[str, str], ...] = ()
    _compiled: tuple[tuple[re.Pattern, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = []
        for pattern, replacement in self.rename:
            try:
                compiled.append((re.compile(pattern), replacement))
            except re.error as exc:
                raise ValueError(f"invalid rename pattern {pattern!r}: {exc}") from None
        object.__setattr__(self, "_compiled", tuple(compiled))

    def dropped(self, name: str) -> bool:
        return any(fnmatchcase(name, glob) for glob in self.drop)

    def renamed(self, name: str) -> str:
        for pattern, replacement in self._compiled:
            try:
                name = pattern.sub(replacement, name)
            except (re.error, IndexError) as exc:
                raise ValueError(f"rename {pattern.pattern!r} -> {replacement!r} failed on {name!r}: {exc}") from None
        return name

    def apply(self, names: Iterable[str]) -> dict[str, str]:
        """Source name -> new name for every entry kept, in order; two entries may not end with one name."""
        mapping: dict[str, str] = {}
        owner: dict[str, str] = {}
        for name in names:
            if self.dropped(name):
                continue
            new = self.renamed(name)
            if not new:
                raise MismatchError(f"the rename rules turn {name!r} into an empty name", key=name)
            if new in owner:
                raise MismatchError(f"the rename rules give {owner[new]!r} and {name!r} the same name {new!r}",
                                    key=new)
            owner[new] = name
            mapping[name] = new
        return mapping


@dataclass(frozen=True)
class CastRules:
    """Target dtypes for floating-point tensors: ``(glob or None for all, dtype)`` pairs, the last
    matching pair wins. Integer and boolean tensors are never cast."""

    rules: tuple[tuple[str | None, torch.dtype], ...] = ()

    @staticmethod
    def parse(texts: Iterable[str]) -> "CastRules":
        """From ``"bfloat16"`` (every floating tensor) or ``"GLOB=bfloat16"`` strings."""
        return CastRules(tuple(CastRules.parse_rule(text) for text in texts))

    @staticmethod
    def parse_rule(text: str) -> tuple[str | None, torch.dtype]:
        glob, _, dtype = text.rpartition("=")
        return glob or None, parse_dtype(dtype)

    def dtype_for(self, name: str, dtype: torch.dtype) -> torch.dtype:
        if not dtype.is_floating_point:
            return dtype
        for glob, target in reversed(self.rules):
            if glob is None or fnmatchcase(name, glob):
                return target
        return dtype
