"""What one process keeps for checkpointing, with one owner and one end.

The Runtime holds the plan cache, the host buffers of asynchronous saves, the background lane
that commits them in order, the staging buffers of loads, the accelerator (``device_copies``) and
the pinned chunks its copies go through (``chunked_copies``); the coordination it uses (bcp's gloo
side groups, gRPC coordinators) is held by ``bcp.coord`` for the process groups they serve. All of it is released

- when its process group is destroyed (``dist.destroy_process_group()``, with or without a group):
  pending asynchronous saves are finished first, then the side groups and gRPC coordinators of the
  destroyed groups are shut down, and once no process group is left, the background lane's threads
  stop too (a later asynchronous save starts them again);
- by :func:`shutdown` (every rank calls it), which releases everything;
- at interpreter exit, from a hook that runs before ``concurrent.futures``' and ``atexit``'s and
  so before torch's own teardown: pending asynchronous saves are finished (the process says what
  it waits for on stderr; a Ctrl-C abandons them and removes their uncommitted files), then
  everything is released while the interpreter is still whole. A gloo group left to the final
  teardown can abort the process (see ``bcp.coord.side_group``).

``reset_runtime()`` (tests) waits for pending saves and starts afresh, keeping the coordination;
given an accelerator (a test's stand-in for a device), the new runtime copies through it.
"""

from __future__ import annotations

import os
import signal
import sys
from concurrent.futures import Future

import torch.distributed as dist

from bcp.coord import release_connections
from bcp.engine.background import BackgroundLane
from bcp.engine.chunked_copies import CHUNK_BYTES, PinnedChunks
from bcp.engine.device_copies import Accelerator, TorchAccelerator
from bcp.engine.load_staging import LoadStagingPool
from bcp.engine.shared_memory import shared_memory_available
from bcp.engine.staging import HostBufferPool
from bcp.planning.plan_cache import PlanCache
from bcp.planning.reuse_memory import ReuseMemory
from bcp.torch_internals.distributed import at_exit_before_thread_pools, on_groups_destroyed

#: After a Ctrl-C at exit, how long the abandoned saves get to stop and remove their files.
ABANDON_WAIT_S = 30.0
#: How long abandoned saves get to fail together: when every rank abandons (one terminal's Ctrl-C
#: reaches them all), their commit barrier ends with every rank's report, so the coordinating rank
#: knows every write has ended and removes the generation whole. Past this, the barrier is broken
#: (a rank that is not abandoning would keep it waiting until the timeout).
ABANDON_TOGETHER_S = 5.0


class Runtime:
    """A process's checkpointing state."""

    def __init__(self, accelerator: Accelerator | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.plan_cache = PlanCache()
        #: Torch's accelerator (none on a CPU-only machine), or a stand-in a test gives.
        self.accelerator = accelerator if accelerator is not None else TorchAccelerator()
        #: The pinned chunks that copies between accelerator and host memory go through.
        self.chunks = PinnedChunks(self.accelerator, chunk_bytes)
        #: Two sets: the next save stages into one while the previous one still writes from the other.
        #: Shared memory where the platform has it: the writer process reads the staged bytes there.
        self.buffers = HostBufferPool(max_sets=2, shared=shared_memory_available(), accelerator=self.accelerator)
        self.background = BackgroundLane()
        #: The last load's staging buffers, which the next load reuses.
        self.load_staging = LoadStagingPool()
        #: What recent saves stored and how they saw each tensor: the base of incremental saves.
        self.reuse = ReuseMemory()

    def close(self) -> None:
        """Wait for every pending save, then release the lane's thread, the cached plans, the host
        buffers, the pinned chunks and the load staging buffers."""
        self.background.close()
        self.buffers.clear()
        self.plan_cache.clear()
        self.load_staging.clear()
        self.chunks.clear()
        self.reuse.forget()


_current = Runtime()


def runtime() -> Runtime:
    """This process's runtime."""
    return _current


def reset_runtime(accelerator: Accelerator | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Wait for this process's pending saves, then replace its runtime with a fresh one (copying
    through ``accelerator``, in chunks of ``chunk_bytes``, where given)."""
    global _current
    previous, _current = _current, Runtime(accelerator, chunk_bytes)
    previous.close()


def shutdown(abandon: bool = False) -> None:
    """Release everything bcp holds in this process: finish the pending asynchronous saves (with
    ``abandon``, stop them instead and remove their uncommitted files), stop the background
    threads, shut down bcp's gloo groups and gRPC coordinators, drop cached plans and host buffers.
    Every rank calls it, as it would ``destroy_process_group``; a later save or load starts afresh.
    Returns once all of it is released."""
    global _current
    previous, _current = _current, Runtime()
    if abandon:
        previous.background.stop_writing()
        _stop_pending(previous.background, None)
    previous.background.wait_pending()
    release_connections(every=True)
    previous.close()


def _after_groups_destroyed() -> None:
    # The side groups are bcp's own, independent of the destroyed groups: pending saves can still
    # commit over them, and are let finish before their groups go.
    _current.background.wait_pending()
    release_connections()
    if not dist.is_initialized():  # the world is gone too: so are the lane's threads (restarted on demand)
        _current.background.close()
        _current.buffers.clear()


def _at_exit() -> None:
    jobs: list[tuple[Future, str]] = []
    try:
        lane = _current.background
        jobs = lane.pending_jobs()
        if jobs:
            try:  # a Ctrl-C from the moment the message is out abandons, as it says
                _say(f"waiting for {len(jobs)} asynchronous save(s) to commit before this process exits: "
                     f"{'; '.join(label for _, label in jobs)}. Press Ctrl-C to abandon them (their uncommitted "
                     "files are removed; the last committed checkpoint stays the latest).")
                lane.wait_pending()
            except KeyboardInterrupt:
                _abandon(lane, jobs)
        release_connections(every=True)
        _current.close()
    except KeyboardInterrupt:  # yet another Ctrl-C: leave now, saying what became of each save
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # more Ctrl-Cs: no traceback from bcp
        try:
            _say("exiting at once" + "".join(f"; {fate}" for fate in _fates(jobs)) + ".")
        finally:
            signal.signal(signal.SIGINT, previous)


def _fates(jobs: list[tuple[Future, str]]) -> list[str]:
    """What became of each save in ``jobs`` so far, in words, those with one fate together."""
    committed = [label for future, label in jobs if future.done() and future.exception() is None]
    failed = [label for future, label in jobs if future.done() and future.exception() is not None]
    running = [label for future, label in jobs if not future.done()]
    return [*([f"committed {len(committed)} asynchronous save(s): {'; '.join(committed)}"] if committed else []),
            *([f"abandoned {len(failed)} asynchronous save(s): {'; '.join(failed)}; their uncommitted files were "
               "removed"] if failed else []),
            *([f"{len(running)} asynchronous save(s) did not stop: {'; '.join(running)}; their uncommitted files "
               "never load as a checkpoint and the next commit removes them"] if running else [])]


def _stop_pending(lane: BackgroundLane, wait_s: float | None) -> bool:
    """After ``lane.stop_writing()``: a commit barrier still waiting for other ranks after
    ``ABANDON_TOGETHER_S`` fails then. Whether the saves ended within ``wait_s`` seconds (None: no limit)."""
    if lane.wait_pending(ABANDON_TOGETHER_S):
        return True
    release_connections(every=True)
    return lane.wait_pending(wait_s)


def _abandon(lane: BackgroundLane, jobs: list[tuple[Future, str]]) -> None:
    lane.stop_writing()
    running = sum(not future.done() for future, _ in jobs)
    if running:  # a save may have committed while the Ctrl-C came
        _say(f"abandoning {running} asynchronous save(s): their writes stop now.")
    _stop_pending(lane, ABANDON_WAIT_S)
    _say("; ".join(_fates(jobs)) + ".")


def _say(message: str) -> None:
    # One write per line: the ranks of a job often share a terminal, and print() writes the line's
    # end apart, so that two ranks' lines could run together.
    sys.stderr.write(f"bcp: {message}\n")
    sys.stderr.flush()


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker, Megatron's checkpoint process) inherits the parent's
    # pending saves but not the thread that runs them: waiting for them at its exit would hang.
    global _current
    _current = Runtime()


# concurrent.futures refuses new work once its own exit hook has run, and a save's writers use
# thread pools: our hook must run before that one.
at_exit_before_thread_pools(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
if dist.is_available():
    on_groups_destroyed(_after_groups_destroyed)
