"""The public entry points: ``save``, ``load`` and what they return."""

from bcp.api.load import load
from bcp.api.options import LoadOptions, SaveOptions
from bcp.api.results import LoadResult, PhaseStats, SaveHandle
from bcp.api.save import save, wait_pending_saves

__all__ = ["save", "load", "SaveOptions", "LoadOptions", "SaveHandle", "LoadResult", "PhaseStats",
           "wait_pending_saves"]
