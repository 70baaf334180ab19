"""The surface that framework integrations (bcp-megatron, bcp-lightning, bcp-accelerate, or your
own) build on. Everything an integration needs from the core is exported here or from ``bcp``;
integrations import nothing else, so the core's internals can change without breaking them (a
test walks their imports).

- coordination: the coordinator and the error-agreeing exchanges built on it;
- representation: boxes, pieces and the dtype names of the format;
- the reader door: a committed checkpoint opened for reading (the manifest, wanted pieces, values);
- storage: the backend for a path or URL;
- framework files: a framework's own pickled files in a checkpoint folder, read safely.
"""

from __future__ import annotations

from bcp.adapters.optimizer import initialize_state
from bcp.api.location import resolve as checkpoint_location
from bcp.coord import Coordinator, default_coordinator
from bcp.coord.consensus import Outcome, all_agree, broadcast_from_root, gather_then_reply
from bcp.framework_pickle import refusing_pickled_code
from bcp.layout.box import Box, flat_range_to_boxes
from bcp.layout.dtypes import dtype_from_name, dtype_name
from bcp.layout.manifest import Manifest, ObjectEntry, TensorEntry
from bcp.planning.pieces import Piece, pieces_of
from bcp.storage import Storage, storage_for

__all__ = [
    "Coordinator", "default_coordinator", "Outcome", "all_agree", "gather_then_reply", "broadcast_from_root",
    "Box", "flat_range_to_boxes", "Piece", "pieces_of", "dtype_from_name", "dtype_name",
    "Manifest", "ObjectEntry", "TensorEntry",
    "checkpoint_location", "initialize_state",
    "Storage", "storage_for",
    "refusing_pickled_code",
]
