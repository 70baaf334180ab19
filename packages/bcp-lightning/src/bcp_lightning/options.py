"""How ``BCPCheckpointIO`` calls ``bcp.save``/``bcp.load``, and the per-save overrides Lightning's
``storage_options`` may carry (the one place they are translated: storage backends for URLs will
add their keys here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import bcp
from bcp.integration import DEFAULT_IO_THREADS

__all__ = ["DEFAULT_IO_THREADS", "DEFAULT_KEEP_GENERATIONS", "Options", "STORAGE_OPTION_TYPES", "for_save"]

DEFAULT_KEEP_GENERATIONS = bcp.SaveOptions().keep_generations


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """How the plugin calls ``bcp.save``/``bcp.load``: bcp's own options, one object per direction."""

    save: bcp.SaveOptions
    load: bcp.LoadOptions

    @staticmethod
    def of(*, async_save: bool = False, allow_pickle: bool = False, verify: bool = True,
           verify_replicas: bool = False, io_threads: int = DEFAULT_IO_THREADS,
           keep_generations: int = DEFAULT_KEEP_GENERATIONS, load_generation: int | None = None,
           incremental: bool = False, overlap: bool = False,
           compression: "bcp.Compression | str | bool | None" = None) -> "Options":
        """``async_save``: return from a save once bcp has staged it in host memory (it commits in
        the background, in call order; pending saves are waited for before a load, before their path
        is removed, at teardown and at exit). ``allow_pickle``: let values outside bcp's safe
        encoding (callbacks' or hyper-parameters' state) be pickled, and such checkpoints loaded.
        ``keep_generations``: committed generations kept when one checkpoint path is saved again
        (``last.ckpt``); each costs the checkpoint's size on disk. ``load_generation``: the kept
        generation that loads read instead of the newest (a roll-back; ``bcp inspect`` lists them).
        ``incremental``: a path saved again (``last.ckpt``) gets only the tensors that changed written
        (``docs/incremental.md``). ``overlap`` (with ``async_save``): return before the parameters and
        optimizer state are copied to host memory; the fit's optimizers wait for the copy before they
        step (``bcp.SaveOptions.overlap``). ``compression``: the tensors' bytes compressed losslessly
        (``"zstd"`` or ``True``; ``bcp.SaveOptions.compression``). The others as in
        ``bcp.SaveOptions``/``bcp.LoadOptions``."""
        return Options(save=bcp.SaveOptions(async_save=async_save, allow_pickle=allow_pickle,
                                            verify_replicas=verify_replicas, io_threads=io_threads,
                                            keep_generations=keep_generations, incremental=incremental,
                                            overlap=overlap, compression=compression),
                       load=bcp.LoadOptions(allow_pickle=allow_pickle, verify=verify, io_threads=io_threads,
                                            generation=load_generation))


#: The ``storage_options`` keys a save honours, with the types their values may have. They override
#: the plugin's options for that one save.
STORAGE_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "async_save": (bool,), "allow_pickle": (bool,), "verify_replicas": (bool,), "io_threads": (int,),
    "incremental": (bool,), "overlap": (bool,), "compression": (str, bool, bcp.Compression),
}
_EXPECTED = {(bool,): "a bool", (int,): "a positive int", (str, bool, bcp.Compression): "a codec name ('zstd'), a bool "
             "or a bcp.Compression"}


def for_save(options: bcp.SaveOptions, storage_options: Any | None, path: str) -> bcp.SaveOptions:
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
        if type(value) not in expected or (expected == (int,) and value < 1):
            raise bcp.CheckpointError(f"storage_options[{key!r}] must be {_EXPECTED[expected]}, got {value!r}",
                                      path=path, key=key)
    return options.merged(storage_options)
