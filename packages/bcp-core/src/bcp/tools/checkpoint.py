"""Reading a committed checkpoint piece by piece: one tensor, a slice of one, or one value, without
loading the rest. This is the core's reader door (``bcp.api.checkpoint``), re-exported for the tools."""

from bcp.api.checkpoint import Checkpoint, open_checkpoint, read_tensor

__all__ = ["Checkpoint", "open_checkpoint", "read_tensor"]
