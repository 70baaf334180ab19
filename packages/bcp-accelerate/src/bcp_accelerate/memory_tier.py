"""``save_state``/``load_state`` into a ``bcp.MemoryTier``: node memory, replicated to peer nodes,
with a persistent copy every few saves (``docs/accelerate.md``, "Memory tier").

A tier has no folder for accelerate's own files (schedulers, samplers, RNG states, the gradient
scaler), and a folder beside it would be lost with the node. So they go into the checkpoint itself:
accelerate writes them into a local temporary folder with its own functions, and each process
saves the bytes of the files it wrote as its value of the ``accelerate_files`` component (the main
process's holds the shared files, every process's its RNG state). They are replicated and persisted
with the tensors and committed by the same commit. A load gives each process its own value (rank
``r`` the files saved by rank ``r``) and the main process's shared files, writes them into a
temporary folder and lets accelerate load them from there, as from a checkpoint folder.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import accelerate
from accelerate.utils.constants import RNG_STATE_NAME

import bcp
from bcp_accelerate import components, engine, generations, hooks, save_options
from bcp_accelerate.accelerate_patch import prepared
from bcp_accelerate.consensus import on_all_ranks

#: The bcp component holding, per process, the bytes of accelerate's files by file name.
FILES = "accelerate_files"

_ATTRIBUTE = "_bcp_memory_tier"
_PENDING = "_bcp_tier_pending"


def set_tier(accelerator: Any, tier: "bcp.MemoryTier | None") -> None:
    if tier is not None and not isinstance(tier, bcp.MemoryTier):
        raise TypeError(f"memory_tier takes a bcp.MemoryTier, got {type(tier).__name__}")
    setattr(accelerator, _ATTRIBUTE, tier)


def wait_pending(accelerator: Any) -> None:
    """Block until the accelerator's asynchronous save into a tier, if one is in flight, has
    committed; raise its failure."""
    handle = getattr(accelerator, _PENDING, None)
    setattr(accelerator, _PENDING, None)
    if handle is not None:
        handle.wait()


def tier_for(accelerator: Any, folder: Any) -> "bcp.MemoryTier | None":
    """The tier a ``save_state``/``load_state`` call goes to: the one it names, else, where it names
    no folder, the accelerator's (``enable(..., memory_tier=)``); None: a folder."""
    if isinstance(folder, bcp.MemoryTier):
        return folder
    return getattr(accelerator, _ATTRIBUTE, None) if folder is None else None


def save_state(accelerator: accelerate.Accelerator, output_dir: Any = None, safe_serialization: bool = True,
               **save_model_func_kwargs: Any) -> Any:
    """``Accelerator.save_state`` through bcp, into a memory tier where the call or the accelerator
    names one, else into a folder (``engine.save_state``). Returns the tier or the folder."""
    wait_pending(accelerator)
    tier = tier_for(accelerator, output_dir)
    if tier is None:
        return engine.save_state(accelerator, output_dir, safe_serialization, **save_model_func_kwargs)
    engine.check_supported(accelerator.distributed_type)
    saved_models = on_all_ranks(lambda: hooks.models_to_save(accelerator, tier), "running the save_state pre-hooks")
    files = _written_files(lambda folder: engine.save_accelerate_files(accelerator, folder, safe_serialization))
    state = engine.state_to_save(accelerator, saved_models, files=None)
    state[FILES] = files
    options = save_options.for_tier(accelerator)
    stepping = tuple(components.torch_optimizer(o) for o in prepared(accelerator, "optimizers"))
    handle = bcp.save(tier, state, options, topology=engine.process_topology(accelerator), step=accelerator.step,
                      incremental=generations.incremental(accelerator),
                      overlap_optimizers=stepping if options.overlap else ())
    setattr(accelerator, _PENDING, handle)
    if not options.async_save:
        wait_pending(accelerator)
    accelerator.project_configuration.iteration += 1
    return tier


def load_state(accelerator: accelerate.Accelerator, input_dir: Any = None, load_kwargs: dict | None = None, *,
               accelerate_load_state: Callable[..., Any], **load_model_func_kwargs: Any) -> None:
    """``Accelerator.load_state`` through bcp, from a memory tier where the call or the accelerator
    names one (the newest generation complete in node memory, else the persistent copy), else from a
    folder (``engine.load_state``)."""
    wait_pending(accelerator)
    tier = tier_for(accelerator, input_dir)
    if tier is None:
        return engine.load_state(accelerator, input_dir, load_kwargs, accelerate_load_state=accelerate_load_state,
                                 **load_model_func_kwargs)
    engine.check_supported(accelerator.distributed_type)
    engine.check_load_options(load_model_func_kwargs)
    loaded_models = on_all_ranks(lambda: hooks.models_to_load(accelerator, tier), "running the load_state pre-hooks")
    record = engine.read_record(tier, load_model_func_kwargs.get("generation"))
    on_all_ranks(lambda: engine.check_matches(record, accelerator, loaded_models, tier.display), "checking the checkpoint")
    state = engine.load_models(accelerator, tier, record, loaded_models, load_model_func_kwargs, extra={FILES: None})
    own = state[FILES]
    shared = on_all_ranks(lambda: _shared(own), "sharing accelerate's files of the main process")
    on_all_ranks(lambda: _load_files(accelerator, {**shared, **own}, load_kwargs, tier.display),
                 f"loading accelerate's files from the {tier.display}")
    accelerator.step = record["step"]


def _written_files(write: Callable[[str], None]) -> dict[str, bytes]:
    """The files ``write`` puts into an empty local folder, by name. Every process writes, each
    in step with the others: a failure anywhere is raised everywhere."""
    def written() -> dict[str, bytes]:
        with tempfile.TemporaryDirectory(prefix="bcp-accelerate-") as folder:
            write(folder)
            return {name: _read(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}

    files: dict[str, bytes] = {}

    def keep() -> None:
        files.update(written())

    on_all_ranks(keep, "writing accelerate's files")
    return files


def _read(path: str) -> bytes:
    if not os.path.isfile(path):
        raise bcp.UnsupportedValueError(f"accelerate wrote {os.path.basename(path)!r}, which is not a file: bcp "
                                        "stores accelerate's files in a memory tier's checkpoint one file at a time")
    with open(path, "rb") as f:
        return f.read()


def _shared(files: dict[str, bytes]) -> dict[str, bytes]:
    """The files every process reads (schedulers, samplers, scaler): all but the RNG states, which
    are each process's own."""
    return {name: data for name, data in files.items() if not name.startswith(RNG_STATE_NAME)}


def _load_files(accelerator: accelerate.Accelerator, files: dict[str, bytes], load_kwargs: dict | None,
                tier: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bcp-accelerate-") as folder:
        for name, data in files.items():
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise bcp.CorruptCheckpointError(f"{FILES} names a file {name!r}, which is not a plain file name",
                                                 path=tier, key=FILES)
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        engine.load_accelerate_files(accelerator, folder, load_kwargs, loaders_in_bcp=True, source=(tier, FILES))
