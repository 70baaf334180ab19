"""The surface that framework integrations (bcp-megatron, bcp-lightning, bcp-accelerate, or your
own) build on. Everything an integration needs from the core is exported here or from ``bcp``;
integrations import nothing else, so the core's internals can change without breaking them (a
test walks their imports).

- coordination: the coordinator and the error-agreeing exchanges built on it;
- representation: boxes, pieces, the one exact-coverage check and the dtype names of the format;
- the reader door (a committed checkpoint opened for reading: the manifest, wanted pieces, values),
  the options of save and load (``DEFAULT_IO_THREADS``, their default parallelism), and the
  process's runtime (plan cache, buffers, async lane);
- the load sequence: ``load_wanted`` reads the tensor pieces and values an integration's ``Wanted``
  names, verifies them, agrees across ranks and applies (transactional, ``read_once``, metrics
  record, the GC paused), as ``bcp.load`` does for its own states; an ``UndoableWanted`` records
  in an ``Undo`` how to take its apply back when the load fails on any rank;
- where checkpoints live (``checkpoint_location(path, role)``: generations and their commit
  state), the storage backend for a path or URL and ``is_url``, the one test of which a path is;
- adapters: ``initialize_state`` gives a never-stepped optimizer its state before a load,
  ``state_to_load_into`` the state for a load to fill without changing the optimizer,
  ``replace_state`` gives it the loaded state as ``Optimizer.load_state_dict`` would; the
  core's optimizer value names (``OPTIMIZER_STATE_PREFIX``, ``OPTIMIZER_PARAM_GROUPS``) and
  ``nested_optimizer_state``/``flat_optimizer_values`` between them and torch's FQN-keyed dicts;
  ``adapter_for`` finds the registered adapter for live objects, by name, as ``bcp.save`` does;
  ``DATALOADER_COMPONENT`` is the state-dict entry ``bcp.save`` treats as per-rank data positions;
  ``follow_order``/``drawn_from``/``replay_order``: a shuffled sampler's epoch order as the
  generator state it was drawn from, replayed on resume; a loader's position in its epoch
  (``loader_position``, from the order it walks: ``order_of_sampler``, ``distributed_order``,
  ``rebuild_order``, ``order_shape``, and the
  rank's ``Walk`` of it, ``natural_walk``) and how a rank of another number continues every saved
  rank's (``plan_resume``, delivered by ``deliver_resume``; ``resumed_epoch_of`` and
  ``unwrap_resumed`` see through a loader delivering one; ``restore_generator``); a saved position as
  one typed record (``SavedPosition``, both the current shape and the draw saved alone before
  positions) and the steps an integration's resume shares with the others (``batching_of``,
  ``consumed_batches``, ``refuse_unfollowed_draw``, ``continue_own``): each integration supplies only
  its sampler and shard accessors;
- framework files: a framework's own pickled files in a checkpoint folder, read safely;
- private names: ``private_name(owner, name, distribution=..., tested=...)`` reads a framework's
  private name and fails with a ``MovedNameError`` naming it and the versions it was tested in where
  it moved, as the core's own reads of torch's private names do (each integration keeps its names
  in one module);
- engine switches: ``requested_engine(variable, engines)`` reads the environment variable through
  which a user picks an integration's checkpoint engine (at each call). The import hook that imports
  an integration once its framework is imported is ``bcp_after_import.after_import``, a module beside
  ``bcp`` because anything under ``bcp`` imports torch.
"""

from __future__ import annotations

from bcp.adapters import adapter_for
from bcp.adapters.dataloader import COMPONENT as DATALOADER_COMPONENT
from bcp.adapters.optimizer import PARAM_GROUPS as OPTIMIZER_PARAM_GROUPS
from bcp.adapters.optimizer import STATE as OPTIMIZER_STATE_PREFIX
from bcp.adapters.optimizer import flat_optimizer_values, initialize_state, nested_optimizer_state, replace_state
from bcp.adapters.optimizer import state_to_load_into
from bcp.adapters.drawn_order import draws_its_order, drawn_from
from bcp.adapters.drawn_order import follow as follow_order
from bcp.adapters.drawn_order import replay as replay_order
from bcp.adapters.engine_switch import requested_engine
from bcp.adapters.distributed_sampler import loaders_own_batch_sampler
from bcp.adapters.epoch_order import distributed as distributed_order
from bcp.adapters.epoch_order import of_sampler as order_of_sampler
from bcp.adapters.epoch_order import rebuild as rebuild_order
from bcp.adapters.epoch_order import shape as order_shape
from bcp.adapters.epoch_positions import Resume, natural_walk, restore_generator
from bcp.adapters.epoch_positions import deliver as deliver_resume
from bcp.adapters.epoch_positions import plan as plan_resume
from bcp.adapters.epoch_positions import position as loader_position
from bcp.adapters.epoch_walks import Walk
from bcp.adapters.loader_positions import (SavedPosition, batching_of, consumed_batches, continue_own,
                                           refuse_unfollowed_draw)
from bcp.adapters.resumed_epoch import original_of as unwrap_resumed
from bcp.adapters.resumed_epoch import resumed as resumed_epoch_of
from bcp.torch_internals.dataloader import state_batches_yielded as batches_yielded
from bcp.api.checkpoint import Checkpoint, open_checkpoint
from bcp.api.load import UndoableWanted, Want, Wanted, load_wanted
from bcp.api.location import resolve as checkpoint_location
from bcp.api.options import DEFAULT_IO_THREADS, LoadOptions, SaveOptions
from bcp.api.runtime import Runtime, reset_runtime, runtime
from bcp.api.undo import Undo
from bcp.coord import Coordinator, as_coordinator, default_coordinator
from bcp.coord.consensus import Outcome, all_agree, broadcast_from_root, gather_then_reply
from bcp.layout.framework_pickle import refusing_pickled_code
from bcp.layout.box import Box, flat_range_to_boxes
from bcp.layout.coverage import CoverProblem, first_cover_problem
from bcp.layout.dtypes import dtype_from_name, dtype_name
from bcp.layout.manifest import Manifest, ObjectEntry, TensorEntry
from bcp.layout.piece import Piece
from bcp.planning.pieces import pieces_of
from bcp.storage import Storage, is_url, storage_for
from bcp.torch_internals import MovedNameError, private_name

__all__ = [
    # coordination
    "Coordinator", "as_coordinator", "default_coordinator", "Outcome", "all_agree", "gather_then_reply",
    "broadcast_from_root",
    # representation
    "Box", "flat_range_to_boxes", "Piece", "pieces_of", "CoverProblem", "first_cover_problem",
    "dtype_from_name", "dtype_name", "Manifest", "ObjectEntry", "TensorEntry",
    # the doors, their options, the process's runtime
    "Checkpoint", "open_checkpoint", "SaveOptions", "LoadOptions", "DEFAULT_IO_THREADS", "Runtime", "runtime",
    "reset_runtime",
    # the load sequence for wanted pieces and values of an integration's own
    "load_wanted", "Wanted", "Want", "UndoableWanted", "Undo",
    # where checkpoints live: generations and their commit state; storage backends
    "checkpoint_location", "Storage", "storage_for", "is_url",
    # adapters
    "initialize_state", "state_to_load_into", "replace_state", "adapter_for", "DATALOADER_COMPONENT", "OPTIMIZER_STATE_PREFIX", "OPTIMIZER_PARAM_GROUPS",
    "nested_optimizer_state", "flat_optimizer_values", "batches_yielded",
    "draws_its_order", "drawn_from", "follow_order", "replay_order",
    "loader_position", "order_of_sampler", "distributed_order", "rebuild_order", "order_shape", "natural_walk", "Walk", "plan_resume", "Resume",
    "deliver_resume", "resumed_epoch_of", "unwrap_resumed", "restore_generator", "loaders_own_batch_sampler",
    "SavedPosition", "batching_of", "consumed_batches", "refuse_unfollowed_draw", "continue_own",
    # frameworks' own pickled files in a checkpoint folder, read safely
    "refusing_pickled_code",
    # a framework's private name, read where its tested versions have it
    "private_name", "MovedNameError",
    # the environment variable that picks an integration's checkpoint engine
    "requested_engine",
]
