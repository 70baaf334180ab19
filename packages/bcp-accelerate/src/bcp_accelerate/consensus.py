"""The phases around bcp's own save and load (choosing the folder, the user's hooks, accelerate's
files) run on every rank in step: a failure on any rank is raised on every rank, so no rank is left
waiting in a collective that a failed rank will never join, and rank 0's result is everyone's."""

from __future__ import annotations

from typing import Any, Callable

from bcp import CheckpointError
from bcp.integration import Outcome, all_agree, default_coordinator


def on_all_ranks(work: Callable[[], Any], what: str) -> Any:
    """Rank 0's result of ``work`` (plain data: lists, strings, numbers). A rank where ``work``
    failed raises its own exception; the other ranks raise a ``bcp.DistributedError`` naming it."""
    outcome = Outcome.of(work)
    try:
        return all_agree(default_coordinator(), outcome, what)[0]
    except CheckpointError:
        if outcome.error is not None:
            raise outcome.error from None
        raise
