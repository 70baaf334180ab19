"""How ``BCPCheckpointIO`` calls ``bcp.save``/``bcp.load``, and the per-save overrides Lightning's
``storage_options`` may carry (the one place they are translated: storage backends for URLs will
add their keys here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import bcp

DEFAULT_IO_THREADS = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """How the plugin calls ``bcp.save``/``bcp.load``."""

    async_save: bool = False
    """Return from a save once bcp has staged it in host memory; it commits in the background, in
    call order. Pending saves are waited for before a load, before their path is removed, at
    teardown and at exit."""
    allow_pickle: bool = False
    """Let values outside bcp's safe encoding (in callbacks' or hyper-parameters' state) be pickled,
    and such checkpoints be loaded. Off: those values fail at save time, naming the entry."""
    verify: bool = True
    """Check every byte read against its checksum."""
    verify_replicas: bool = False
    """At save, check by checksum that tensors replicated across ranks are identical."""
    io_threads: int = DEFAULT_IO_THREADS
    """Threads per rank reading or writing data files."""


#: The ``storage_options`` keys a save honours, with the type each value must have. They override
#: the plugin's options for that one save.
STORAGE_OPTION_TYPES: dict[str, type] = {
    "async_save": bool, "allow_pickle": bool, "verify_replicas": bool, "io_threads": int,
}


def for_save(options: Options, storage_options: Any | None, path: str) -> Options:
    """``options`` with the overrides of ``Trainer.save_checkpoint(..., storage_options=...)``; a
    key bcp does not understand, or a value of the wrong type, is an error naming it."""
    if storage_options is None:
        return options
    if not isinstance(storage_options, Mapping):
        raise bcp.CheckpointError(f"storage_options must be a dict, got {type(storage_options).__name__}", path=path)
    for key, value in storage_options.items():
        expected = STORAGE_OPTION_TYPES.get(key)
        if expected is None:
            raise bcp.CheckpointError(
                f"storage_options key {key!r} is not understood; bcp_lightning honours "
                f"{sorted(STORAGE_OPTION_TYPES)}", path=path, key=str(key))
        # bool is an int: io_threads=True is refused as well.
        if type(value) is not expected or (expected is int and value < 1):
            raise bcp.CheckpointError(
                f"storage_options[{key!r}] must be {'a positive int' if expected is int else 'a bool'}, "
                f"got {value!r}", path=path, key=key)
    return dataclasses.replace(options, **storage_options)
