"""Where bcp reads torch.distributed (and threading) beyond their public API.

- ``distributed_c10d._get_default_store()``: the store the default process group met through, which
  bcp's side groups and the gRPC coordinator meet through too;
- ``distributed_c10d._world.pg_map``: the process groups alive now (a destroyed one leaves it);
- a process group's backend ``options._timeout``: the timeout the group was made with;
- ``distributed_c10d._unregister_process_group`` / ``_unregister_all_process_groups``: torch has no
  callback for a destroyed group; ``destroy_process_group`` (and abort) end by calling these
  module-level functions, looked up at each call, so wrapping them sees every destruction;
- ``threading._register_atexit``: an exit hook that runs before ``concurrent.futures``' own.
"""

from __future__ import annotations

import atexit
import datetime
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from bcp.torch_internals import has_private_name, private_name

_UNREGISTER = ("_unregister_process_group", "_unregister_all_process_groups")
_MARK = "_bcp_watched"


def default_store() -> Any:
    """The store the default process group met through."""
    return private_name(dist.distributed_c10d, "_get_default_store")()


def live_groups() -> dict[Any, Any]:
    """The process groups alive now, keyed by group (empty without torch.distributed)."""
    if not dist.is_available():
        return {}
    return private_name(private_name(dist.distributed_c10d, "_world"), "pg_map")


def group_timeout(group: "dist.ProcessGroup") -> float | None:
    """The timeout ``group`` was made with, in seconds, from its CPU or else its CUDA backend; None
    where neither says (the caller takes its default: torch has no public way to ask)."""
    if not has_private_name(group, "_get_backend"):
        return None
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except RuntimeError:  # the group has no backend for this device
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout.total_seconds()
    return None


def on_groups_destroyed(callback: Callable[[], None]) -> None:
    """Call ``callback()`` after every process group destruction from now on (idempotent). Where torch
    lacks one of the functions, its destructions are not seen at once (bcp's side groups then notice
    them at their next use, through :func:`live_groups`)."""
    c10d = dist.distributed_c10d
    for name in _UNREGISTER:
        original = getattr(c10d, name, None)
        if original is not None and not getattr(original, _MARK, False):
            setattr(c10d, name, _then(original, callback))


def _then(original: Callable[..., Any], callback: Callable[[], None]) -> Callable[..., Any]:
    def unregister(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        callback()
        return result

    setattr(unregister, _MARK, True)
    return unregister


def at_exit_before_thread_pools(hook: Callable[[], None]) -> None:
    """Run ``hook`` at interpreter exit before ``concurrent.futures`` refuses new work: threading's
    exit hooks run before atexit's, newest first. Where that private hook is missing, atexit's."""
    if has_private_name(threading, "_register_atexit"):
        threading._register_atexit(hook)
    else:
        atexit.register(hook)
