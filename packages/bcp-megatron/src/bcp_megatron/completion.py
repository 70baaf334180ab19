"""Megatron's asynchronous-save protocol on top of bcp's.

Megatron runs an ``AsyncRequest``'s ``async_fn`` in a checkpoint process of its own (forked, or a
persistent spawned worker) and calls the ``finalize_fns`` on every rank once every rank's process
has exited. bcp writes and commits an asynchronous save in a background thread of the training
process. The bridge: a watcher thread waits for that save and then creates a marker file;
``async_fn`` only waits for the marker, so Megatron sees the save in progress exactly as long as it
is; the finalize step raises the save's error, if any, on every rank.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from functools import partial

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

import bcp

from bcp_megatron.errors import as_megatron_errors

_POLL_S = 0.02
_MARKER = "done"


def completion_request(handle: bcp.SaveHandle) -> AsyncRequest:
    """An AsyncRequest that completes when the asynchronous bcp save of ``handle`` has finished."""
    folder = tempfile.mkdtemp(prefix="bcp-megatron-save-")
    marker = os.path.join(folder, _MARKER)
    threading.Thread(target=_mark_when_finished, args=(handle, marker), name="bcp-megatron-watch",
                     daemon=True).start()
    return AsyncRequest(wait_for_marker, (marker,), [partial(_finalize, handle, folder)])


def wait_for_marker(marker: str) -> None:
    """``async_fn``: runs in Megatron's checkpoint process; touches nothing but the marker's path."""
    while not os.path.exists(marker):
        time.sleep(_POLL_S)


def _mark_when_finished(handle: bcp.SaveHandle, marker: str) -> None:
    with contextlib.suppress(Exception):  # the finalize step raises the save's error on every rank
        handle.wait()
    with open(marker, "w"):
        pass


@as_megatron_errors()
def _finalize(handle: bcp.SaveHandle, folder: str) -> None:
    try:
        handle.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
