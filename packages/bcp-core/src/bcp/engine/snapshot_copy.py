"""Overlapped snapshots: the copy of an asynchronous save's tensors that only the optimizer writes
(parameters, optimizer state) runs on a thread of its own while training's next forward and
backward run, and whatever writes those tensors waits for it first.

The copy goes into the save's staging buffer (``staging.place`` laid it out), through the same
copies as staging at the call (``staging.copy_in``: host tensors by the thread, device tensors on
bcp's copy stream, ordered after the work queued when the save was called). Every optimizer of the
state waits for it in a step pre-hook; where the step is given a closure (the forward and backward,
run by the step itself, as in Lightning's automatic optimization), a torch optimizer waits after the
closure instead, before its update; the process's next save and load, and
``SaveHandle.wait_snapshot()``, wait for every pending copy (:class:`PendingSnapshots`).

A hook cannot leave the optimizer's hook table while the optimizer walks it (torch raises on a
table changed during the walk), and the copy's thread may end at any moment of a step: so a hook
is removed on the training thread, by the next wait for the copy outside a step (the next save,
a load, ``wait_snapshot``); until then it returns at once.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from bcp.engine.chunked_copies import ChunkedCopies, Pair
from bcp.engine.staging import copy_in

#: A seam for tests: called on the copy's thread before it copies (None in use). A test holds the
#: copy back with it, so that training's next step surely runs before the copy; one that raises
#: stands for a copy that fails.
BEFORE_COPY: Callable[[], None] | None = None


class SnapshotCopy:
    """One save's overlapped copy of ``pairs`` (``(staged view, live tensor)``), started now on a
    thread of its own; ``optimizers`` wait for it before they step."""

    def __init__(self, pairs: Sequence[Pair], copies: ChunkedCopies, optimizers: Sequence[torch.optim.Optimizer],
                 label: str) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        job = [list(pairs), copies]  # emptied by the thread: nothing of the state outlives the copy
        threading.Thread(target=self._run, args=(job,), name=f"bcp-snapshot {label}", daemon=True).start()
        # After the start: a thread that cannot start leaves no hook waiting for it for ever.
        self._hooks = [optimizer.register_step_pre_hook(self._before_step) for optimizer in optimizers]

    def wait(self) -> None:
        """Block until the copy is done (or failed: the save's handle raises that, not this)."""
        self._done.wait()

    def error(self) -> BaseException | None:
        """After :meth:`wait`: the copy's error, if it failed."""
        return self._error

    def finish(self) -> None:
        """Wait for the copy, then take the optimizers' hooks out (on the training thread, outside an
        optimizer step)."""
        self.wait()
        with self._lock:
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()

    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # torch hands a pre-hook the step's own arguments, the optimizer first.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if self._done.is_set():
            return None
        if not callable(closure) or not _evaluates_closure_first(optimizer):
            self._done.wait()
            return None

        # The step runs the forward and backward itself (Lightning's automatic optimization does):
        # waiting after them, before the update, lets them overlap the copy too.
        def closure_then_wait() -> Any:
            loss = closure()
            self._done.wait()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs

    def _run(self, job: list[Any]) -> None:
        pairs, copies = job
        job.clear()
        try:
            if BEFORE_COPY is not None:
                BEFORE_COPY()
            copy_in(pairs, copies)
        except BaseException as exc:  # noqa: BLE001 - the save's write reports it; its handle raises it
            self._error = exc
        finally:
            del pairs, copies
            self._done.set()


def _evaluates_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step(closure)`` calls the closure before it writes a parameter or its
    state: torch's own optimizers do (LBFGS too, and calls it again later). Others may not (a
    sharpness-aware optimizer moves the parameters, then calls it), so they wait before the step."""
    module = type(optimizer).__module__
    return module == "torch.optim" or module.startswith("torch.optim.")


class PendingSnapshots:
    """A process's overlapped copies not yet waited for outside an optimizer step."""

    def __init__(self) -> None:
        self._copies: list[SnapshotCopy] = []
        self._lock = threading.Lock()

    def add(self, copy: SnapshotCopy) -> None:
        with self._lock:
            self._copies.append(copy)

    def wait(self) -> None:
        """Block until every copy is done, and take their optimizer hooks out (call it on the
        training thread, outside an optimizer step)."""
        with self._lock:
            copies, self._copies = self._copies, []
        for copy in copies:
            copy.finish()
