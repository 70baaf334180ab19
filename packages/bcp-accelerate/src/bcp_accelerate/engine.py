"""``save_state``/``load_state`` with every prepared model and optimizer going through bcp.

A save writes accelerate's own files (schedulers, samplers, RNG states, the gradient scaler) with
accelerate's own functions into a fresh sub-folder, then saves models, optimizers, the objects
registered for checkpointing (in bcp's safe encoding, where accelerate would pickle them), the
stateful dataloaders' state (bcp's ``dataloader`` component, one part per process) and a record
of the accelerator through ``bcp.save``, whose commit is the last
write: from then on the folder is a whole checkpoint, before it none.
Pruning to ``total_limit`` runs after the commit. A load reshards models and optimizers into the
layout and number of processes the accelerator has now, then lets accelerate load the rest.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Callable

import accelerate
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state
from accelerate.utils import DistributedType

import bcp
from bcp import AdapterError, CheckpointNotCommittedError, MismatchError
from bcp.integration import checkpoint_location, refusing_pickled_code
from bcp_accelerate import components, dataloaders, folders, framework_files, generations, hooks, places, save_options
from bcp_accelerate.accelerate_patch import prepared
from bcp_accelerate.consensus import on_all_ranks
from bcp_accelerate.engine_variable import ENGINE_VARIABLE

#: The bcp component recording the accelerator: its step counter, what was saved, and the
#: sub-folder holding accelerate's own files.
RECORD = "accelerate"
#: The bcp component of the ``i``-th object registered for checkpointing: ``custom_<i>``.
CUSTOM_PREFIX = "custom_"
_UNSUPPORTED = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.MEGATRON_LM: "Megatron-LM",
                DistributedType.XLA: "XLA"}
_LOAD_OPTIONS = ("strict", "map_location", "generation")


def check_supported(distributed_type: DistributedType) -> None:
    """DeepSpeed and Megatron-LM engines keep their own sharded state in their own formats."""
    if distributed_type in _UNSUPPORTED:
        raise AdapterError(
            f"the bcp checkpoint engine does not handle {_UNSUPPORTED[distributed_type]} models through "
            f"accelerate; unset {ENGINE_VARIABLE} (or do not enable bcp) to use accelerate's own engine")


def save_state(accelerator: accelerate.Accelerator, output_dir: "str | os.PathLike | None" = None,
               safe_serialization: bool = True, **save_model_func_kwargs: Any) -> "Path | str":
    """``Accelerator.save_state`` through bcp. ``safe_serialization`` applies to accelerate's own
    files (bcp never pickles models or optimizers); ``save_model_func_kwargs`` are DeepSpeed's and
    unused, as in accelerate with any other engine. Returns the folder: a ``Path``, or the URL as given."""
    check_supported(accelerator.distributed_type)
    folder = on_all_ranks(lambda: folders.new_folder(accelerator, output_dir), "choosing the checkpoint folder")
    places.make(folder)
    saved_models, files_dir = on_all_ranks(
        lambda: [hooks.models_to_save(accelerator, folder), folders.FILES_DIR_PREFIX + uuid.uuid4().hex[:12]],
        "running the save_state pre-hooks")
    on_all_ranks(lambda: _save_accelerate_files(accelerator, places.join(folder, files_dir), safe_serialization),
                 f"writing accelerate's files to {folder}")

    bcp.save(folder, state_to_save(accelerator, saved_models, files=files_dir), save_options.for_folder(accelerator),
             topology=process_topology(accelerator),
             keep_generations=generations.kept(accelerator), incremental=generations.incremental(accelerator),
             step=accelerator.step).wait()

    # Every rank waits for the clean-up so that none looks at folders being deleted.
    on_all_ranks(lambda: _clean_up(accelerator, folder, files_dir), f"removing what {folder} replaced")
    accelerator.project_configuration.iteration += 1
    return folder if places.is_url(folder) else Path(folder)


def state_to_save(accelerator: accelerate.Accelerator, saved_models: list[int], *, files: str | None) -> dict[str, Any]:
    """What ``bcp.save`` gets: the record, the registered objects, the stateful dataloaders, the
    models the pre-hooks left and every optimizer. ``files``: the sub-folder of accelerate's own
    files, None where they are in the checkpoint itself (``FILES``, a memory tier)."""
    models, optimizers = prepared(accelerator, "models"), prepared(accelerator, "optimizers")
    state: dict[str, Any] = {RECORD: {
        "step": accelerator.step, "models": saved_models, "num_models": len(models),
        "num_optimizers": len(optimizers), "num_custom_objects": len(prepared(accelerator, "custom_objects")),
        "files": files, "custom_objects_in_bcp": True, "dataloaders_in_bcp": True,
    }}
    state.update(_custom_components(accelerator))
    state.update(dataloaders.component(accelerator))
    model = components.model_component(models, saved_models)
    if model is not None:
        state["model"] = model
    if optimizers:
        state["optimizer"] = components.optimizer_component(models, optimizers, for_load=False)
    return state


def load_state(accelerator: accelerate.Accelerator, input_dir: "str | os.PathLike | None" = None,
               load_kwargs: dict | None = None, *, accelerate_load_state: Callable[..., Any],
               **load_model_func_kwargs: Any) -> None:
    """``Accelerator.load_state`` through bcp. Without ``input_dir`` (automatic naming) it resumes
    from the newest committed checkpoint; a folder written by accelerate's own engine is loaded by
    ``accelerate_load_state``. ``strict=False`` loads the overlap of checkpoint and models;
    ``generation=N`` loads a kept older generation of the folder (``bcp inspect`` lists them)."""
    check_supported(accelerator.distributed_type)
    folder, kind = on_all_ranks(lambda: _choose(accelerator, input_dir), "choosing the checkpoint to load")
    if kind == folders.Contents.ACCELERATE.name:
        if load_model_func_kwargs.get("generation") is not None:
            raise bcp.CheckpointNotFoundError("generation= loads a kept generation of a bcp checkpoint; this folder "
                                              "was written by accelerate's own engine, which keeps none", path=folder)
        with framework_files.safe_accelerate_load(folder):
            accelerate_load_state(accelerator, folder, load_kwargs, **load_model_func_kwargs)
    else:
        _load_through_bcp(accelerator, folder, load_kwargs, load_model_func_kwargs)
    folders.continue_numbering(accelerator)


def _choose(accelerator: accelerate.Accelerator, input_dir: "str | os.PathLike | None") -> list[str]:
    folder = folders.folder_to_load(accelerator, input_dir)
    kind = folders.contents(folder)
    if kind is folders.Contents.INCOMPLETE:
        raise CheckpointNotCommittedError(f"cannot load: the folder holds {kind.value}", path=folder)
    return [folder, kind.name]


def _load_through_bcp(accelerator: accelerate.Accelerator, folder: str, load_kwargs: dict | None,
                      options: dict[str, Any]) -> None:
    check_load_options(options)
    loaded_models = on_all_ranks(lambda: hooks.models_to_load(accelerator, folder), "running the load_state pre-hooks")
    generation = options.get("generation")
    record = read_record(folder, generation)
    on_all_ranks(lambda: check_matches(record, accelerator, loaded_models, folder), "checking the checkpoint")
    load_models(accelerator, folder, record, loaded_models, options)
    on_all_ranks(lambda: _load_accelerate_files(accelerator, folder, record["files"], load_kwargs,
                                                record.get("custom_objects_in_bcp", False),
                                                record.get("dataloaders_in_bcp", False)),
                 f"loading accelerate's files from {folder}")
    # The record, unlike the per-process RNG files, reaches processes beyond the saved number.
    accelerator.step = record["step"]


def check_load_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(_LOAD_OPTIONS))
    if unknown:
        raise TypeError(f"load_state() through bcp takes no {', '.join(unknown)} "
                        f"(its model options are {', '.join(_LOAD_OPTIONS)})")


def load_models(accelerator: accelerate.Accelerator, target: Any, record: dict[str, Any], loaded_models: list[int],
                options: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load the models the pre-hooks left, every optimizer, the registered objects and the stateful
    dataloaders (where the record says bcp saved them) and ``extra`` components from ``target`` (a
    folder or a memory tier); returns the loaded state."""
    models, optimizers = prepared(accelerator, "models"), prepared(accelerator, "optimizers")
    state: dict[str, Any] = dict(extra or {})
    model = components.model_component(models, loaded_models)
    if model is not None:
        state["model"] = model
    if optimizers:
        state["optimizer"] = components.optimizer_component(models, optimizers, for_load=True)
    if record.get("custom_objects_in_bcp", False):
        state.update(_custom_components(accelerator))
    if record.get("dataloaders_in_bcp", False):
        state.update(dataloaders.component(accelerator))
    if state:
        bcp.load(target, state, strict=options.get("strict", True), generation=options.get("generation"),
                 topology=process_topology(accelerator))
    if optimizers:
        components.restore_optimizers(state["optimizer"], models, optimizers)
    return state


def load_accelerate_files(accelerator: accelerate.Accelerator, files_dir: str, load_kwargs: dict | None, *,
                          loaders_in_bcp: bool, source: tuple[str, str]) -> None:
    """Accelerate's own loaders of its files (schedulers, samplers, RNG, scaler) over ``files_dir``,
    a local folder; a pickle torch refuses is a ``bcp.UnsafeCheckpointError`` naming ``source``
    (the checkpoint and where in it the files are)."""
    loaders = dataloaders.for_accelerate_files(prepared(accelerator, "dataloaders"), in_bcp=loaders_in_bcp)
    with refusing_pickled_code(*source):
        load_accelerator_state(files_dir, [], [], prepared(accelerator, "schedulers"), loaders,
                               accelerator.process_index, accelerator.scaler, None, load_kwargs)


def save_accelerate_files(accelerator: accelerate.Accelerator, files_dir: str, safe_serialization: bool) -> None:
    """Accelerate's own savers of its files into ``files_dir``, a local folder."""
    save_accelerator_state(files_dir, [], [], prepared(accelerator, "schedulers"),
                           dataloaders.for_accelerate_files(prepared(accelerator, "dataloaders"), in_bcp=True),
                           accelerator.process_index, accelerator.step, accelerator.scaler,
                           save_on_each_node=accelerator.project_configuration.save_on_each_node,
                           safe_serialization=safe_serialization)


def _save_accelerate_files(accelerator: accelerate.Accelerator, files_dir: str, safe_serialization: bool) -> None:
    with places.files_to_write(files_dir) as local:
        save_accelerate_files(accelerator, local, safe_serialization)


def _custom_components(accelerator: accelerate.Accelerator) -> dict[str, Any]:
    """The registered objects as bcp components: bcp saves their ``state_dict()`` per process and
    hands the loaded one to ``load_state_dict``."""
    return {f"{CUSTOM_PREFIX}{i}": obj for i, obj in enumerate(prepared(accelerator, "custom_objects"))}


def _load_accelerate_files(accelerator: accelerate.Accelerator, folder: str, files: str, load_kwargs: dict | None,
                           custom_in_bcp: bool, loaders_in_bcp: bool) -> None:
    with places.files_to_read(places.join(folder, files)) as files_dir:
        load_accelerate_files(accelerator, files_dir, load_kwargs, loaders_in_bcp=loaders_in_bcp,
                              source=(folder, files))
        if not custom_in_bcp:  # a checkpoint from before the objects went into bcp: their .pkl files
            for index, obj in enumerate(prepared(accelerator, "custom_objects")):
                framework_files.load_custom_state(obj, files_dir, index)


def _clean_up(accelerator: accelerate.Accelerator, folder: str, files_dir: str) -> None:
    """On the main process: accelerate's files of earlier saves into ``folder`` that no kept
    generation references any more, and checkpoints beyond ``total_limit``."""
    if not accelerator.is_main_process:
        return
    referenced = {files_dir} | _files_of_older_generations(folder)
    for name in places.names(folder):
        if name.startswith(folders.FILES_DIR_PREFIX) and name not in referenced:
            places.remove(places.join(folder, name))
    folders.prune(accelerator, folder)


def _files_of_older_generations(folder: str) -> set[str]:
    """The sub-folders of accelerate's files that the kept generations before the newest name
    (read by the calling process alone)."""
    location = checkpoint_location(folder, None)
    committed = [g for g in location.generations() if location.is_committed(g)]
    alone = bcp.SingleProcessCoordinator()
    return {read_record(folder, g, alone)["files"] for g in committed[:-1]}


def read_record(folder: Any, generation: int | None = None,
                 coordinator: bcp.Coordinator | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {RECORD: None}
    result = bcp.load(folder, state, strict=False, generation=generation, coordinator=coordinator,
                      metrics_log=False)  # a step of load_state: no record of its own
    if RECORD not in result.loaded:
        raise MismatchError(f"this bcp checkpoint has no {RECORD!r} record: it was not written by "
                            "Accelerator.save_state; load it with bcp.load", path=folder)
    return state[RECORD]


_DESCRIBED = {"num_models": "prepared models", "num_optimizers": "prepared optimizers",
              "num_custom_objects": "objects registered for checkpointing",
              "models": "indices of the models the pre-hooks leave to bcp"}


def check_matches(record: dict[str, Any], accelerator: accelerate.Accelerator, loaded_models: list[int],
                   folder: str) -> None:
    live = {"num_models": len(prepared(accelerator, "models")),
            "num_optimizers": len(prepared(accelerator, "optimizers")),
            "num_custom_objects": len(prepared(accelerator, "custom_objects")), "models": loaded_models}
    differences = [f"{_DESCRIBED[key]}: {record[key]} saved, {value} now" for key, value in live.items()
                   if record[key] != value]
    if differences:
        raise MismatchError("the accelerator does not match the checkpoint: " + "; ".join(differences), path=folder)


def process_topology(accelerator: Any) -> dict[str, int]:
    """The process's place for the metrics records' heat map: Accelerate's process index, which is
    its data-parallel index (the record carries the host and local rank itself)."""
    return {"dp": accelerator.process_index}
