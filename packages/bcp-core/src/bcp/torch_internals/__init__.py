"""The one place the bcp core reads torch beyond its public API, one module per area:

- ``dataloader``: what a loader's iterator has yielded, its batch sampler, read-ahead and the
  iterators a loader makes; torchdata's ``StatefulDataLoader`` state keys;
- ``distributed``: c10d's default store, its registry of live process groups, a group's timeout,
  the hook that sees a group destroyed, and threading's exit hook that runs before
  ``concurrent.futures``' own;
- ``tensors``: a tensor's version counter, the exchange of two storages' memory, a DTensor's
  local shape and global offset;
- ``fsdp1``: FSDP1's flat-parameter bookkeeping and a module's persistent buffers.

It sits at the bottom of the core's layers (above ``bcp.errors`` only), so that every layer that
needs such a name imports it from here. Every private name goes through :func:`private_name`: a name
that moved fails with a :class:`MovedNameError` naming it and the versions bcp was tested in
(``TESTED``), or, where torch has a public way too, the caller takes that one.
``tests/core/test_torch_internals.py`` and ``tests/dataloader/test_dataloader_torch_internals.py``
read every name in the installed versions; ``tests/core/test_architecture.py`` fails on a private
torch, Lightning, Accelerate or Megatron name used anywhere else.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from bcp.errors import CheckpointError

#: torch and torchdata versions (major, minor), from the first up to, not including, the second,
#: whose private names are as read here.
TESTED = {"torch": ((2, 4), (2, 14)), "torchdata": ((0, 8), (0, 12))}


class MovedNameError(CheckpointError):
    """A private name of a framework that bcp relies on is not where the tested versions have it."""


def installed_version(distribution: str) -> tuple[int, ...] | None:
    """The installed ``distribution``'s (major, minor), or None where it is unknown."""
    try:
        text = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        return tuple(int(part.split("+")[0]) for part in text.split(".")[:2])
    except ValueError:
        return None


def tested_range(distribution: str, tested: tuple[tuple[int, int], tuple[int, int]]) -> str:
    """``"<distribution> <low> to before <high> (installed: <version>)"``, for error messages."""
    low, high = (".".join(map(str, v)) for v in tested)
    installed = installed_version(distribution)
    return (f"{distribution} {low} to before {high} "
            f"(installed: {'.'.join(map(str, installed)) if installed else 'unknown'})")


def private_name(owner: Any, name: str, *, distribution: str = "torch",
                 tested: tuple[tuple[int, int], tuple[int, int]] | None = None) -> Any:
    """``owner.name``, a private name of ``distribution``; a :class:`MovedNameError` naming it and
    the versions it was tested in when it is not there."""
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__name__", None) or type(owner).__qualname__
        range_ = tested_range(distribution, tested or TESTED[distribution])
        raise MovedNameError(f"{where}.{name} is missing: bcp reads this private name of {distribution}, "
                             f"tested with {range_}; use a tested version") from None


def private_module(name: str, *, distribution: str = "torch") -> Any:
    """The private module ``name`` of ``distribution``; a :class:`MovedNameError` naming it and the
    tested versions when it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise MovedNameError(f"module {name} is missing: bcp reads this private module of {distribution}, tested "
                             f"with {tested_range(distribution, TESTED[distribution])}; use a tested version") from None


def has_private_name(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` is there, for the callers that take a public way where it is not."""
    return hasattr(owner, name)
