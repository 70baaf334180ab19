"""The jobs of the fresh-process tier: each is what a rank of a training script does around a
checkpoint, ending the way such scripts end. They run in processes forked by ``zygote.py``."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import bcp
from bcp.integration import runtime


#: The process group's timeout in the jobs, and so bcp's (it takes the group's). Beside two busy loops
#: rank 0 once reached a save's first exchange over 30 s after rank 1 (its claim of the generation
#: lies between them); a job that hangs still fails, with bcp's message, before the zygote's timeout.
JOB_GROUP_TIMEOUT_S = 120.0


def _join(timeout_s: float = JOB_GROUP_TIMEOUT_S) -> tuple[int, int]:
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _trained_state(world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 7))
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "extra_state": {"step": 1}}


def _leave(how: str, destroy: bool) -> None:
    if destroy:
        dist.destroy_process_group()
    if how == "exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("the training script failed after its checkpoint")


def save_then_leave(path: str, mode: str = "sync", how: str = "return", destroy: bool = True) -> None:
    """A save (``sync``, ``async`` left pending, ``async-wait``), then the script ends ``how``."""
    _, world = _join()
    state = _trained_state(world)
    if mode == "sync":
        bcp.save(path, state)
    else:
        handle = bcp.save(path, state, async_save=True)
        if mode == "async-wait":
            handle.wait()
    _leave(how, destroy)


def load_then_leave(path: str, how: str = "return", destroy: bool = True) -> None:
    """A load (resharded when the world differs from the saving one), then the script ends."""
    _, world = _join()
    state = _trained_state(world)
    bcp.load(path, state)
    _leave(how, destroy)


def grpc_save_load_then_leave(path: str) -> None:
    """A save and a load through the gRPC coordinator, then a plain return (no destroy)."""
    _, world = _join()
    state = _trained_state(world)
    bcp.save(path, state, coordinator="grpc")
    bcp.load(path, state, coordinator="grpc")


class SlowDisk(bcp.LocalStorage):
    """A local disk that takes ``seconds`` per chunk written: a save still running when a test acts."""

    def __init__(self, root: str, seconds: float) -> None:
        super().__init__(root)
        self.seconds = seconds

    def write_file(self, name, chunks):
        def slowly():
            for chunk in chunks:
                time.sleep(self.seconds)
                yield chunk

        super().write_file(name, slowly())


def interrupted_twice_during_async_save(path: str) -> None:
    """A user's Ctrl-C during an asynchronous save (the first interrupts training, the process then
    waits for the save at exit), and a second Ctrl-C while it waits."""
    # Python's own Ctrl-C handling, as in a terminal: a job started in the background by a
    # non-interactive shell inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _, world = _join()
    state = _trained_state(world)
    bcp.save(path, state)  # the previous, committed checkpoint
    bcp.save(SlowDisk(path, 1.0), state, async_save=True)
    threading.Thread(target=_interrupt_after, args=(1.5,), daemon=True).start()
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C
    time.sleep(30)  # never reached: the KeyboardInterrupt ends the script


def _interrupt_after(seconds: float) -> None:
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGINT)


def only_rank_zero_saves(path: str, warn_after: float, timeout: float, kind: str = "torch") -> None:
    """The classic mistake: ``if rank == 0: bcp.save(...)``, through a coordinator of ``kind`` that
    both ranks built beforehand."""
    rank, world = _join()
    state = _trained_state(world)
    if kind == "torch":
        coordinator = bcp.TorchCoordinator(timeout=timeout, warn_after=warn_after)
    else:
        from bcp.coord.grpc import GrpcCoordinator

        coordinator = GrpcCoordinator(timeout=timeout, warn_after=warn_after)
    if rank == 0:
        bcp.save(path, state, coordinator=coordinator)
    else:
        time.sleep(timeout + 6)  # rank 1 goes on training, never calling bcp, while rank 0 times out


def only_rank_zero_saves_first(path: str, seconds_after: float) -> None:
    """The classic mistake as the first call to bcp, with no coordinator built beforehand and the
    process group's default timeout (half an hour): ``if rank == 0: bcp.save(...)``, bcp's waits
    set by ``BCP_WARN_AFTER_S`` and ``BCP_TIMEOUT_S``. Rank 0 logs through a handler that stamps each
    record with the seconds since its save began; it prints how long the save took to fail."""
    rank, world = _join(timeout_s=1800.0)
    state = _trained_state(world)
    if rank != 0:
        time.sleep(seconds_after)  # rank 1 goes on training, never calling bcp, while rank 0 times out
        return
    started = time.monotonic()
    stamped = logging.StreamHandler(sys.stdout)
    stamped.setFormatter(_SinceStart(started))
    logging.getLogger("bcp").addHandler(stamped)
    try:
        bcp.save(path, state)
    except bcp.DistributedError as exc:
        print(f"raised after {time.monotonic() - started:.1f}s: {exc}", flush=True)
        raise SystemExit(3) from None
    raise AssertionError("rank 0 saved alone")


class _SinceStart(logging.Formatter):
    def __init__(self, started: float) -> None:
        super().__init__()
        self.started = started

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname} after {time.monotonic() - self.started:.1f}s: {record.getMessage()}"


def store_host_dies(when: str, timeout: float, coordinator: str = "torch") -> None:
    """Rank 0 hosts the rendezvous store; it dies (SIGKILL) ``before`` its coordination is set up or
    ``during`` the setup, while the survivor builds the ``coordinator`` (torch's gloo side group or
    the gRPC tree) with a short timeout, then exchanges once. Dying inside the setup is injected by
    replacing the step rank 0 would take there (a kill at an exact point cannot be timed otherwise).
    The survivor may finish a gRPC setup before rank 0 dies (its parent's address was published):
    then its first exchange is what fails."""
    rank, world = _join(timeout_s=timeout)
    dist.barrier()  # both ranks are in the job
    if rank == 0:
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        if coordinator == "torch":
            dist.ProcessGroupGloo = _dying_gloo  # after taking its place in the store
        else:
            from bcp.coord.grpc import coordinator as grpc_coordinator

            grpc_coordinator.look_up = _dying_gloo  # after publishing its address
    started = time.monotonic()
    try:
        if coordinator == "torch":
            built = bcp.TorchCoordinator(timeout=timeout)
        else:
            from bcp.coord.grpc import GrpcCoordinator

            built = GrpcCoordinator(timeout=timeout)
        print("set up without rank 0", flush=True)
        built.all_gather_bytes(b"present")
    except bcp.DistributedError as exc:
        print(f"raised after {time.monotonic() - started:.1f}s: {exc}", flush=True)
        raise SystemExit(3) from None
    raise AssertionError("the coordinator exchanged without rank 0")


def _dying_gloo(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def resources() -> tuple[int, int]:
    """(threads, open file descriptors) of this process."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def cycles_then_count(path: str, cycles: int, use_bcp: bool, settle_s: float) -> None:
    """A job that re-creates its process groups (elastic restarts, Megatron's re-initialization):
    each cycle creates a group, uses it (a barrier), saves through it (sync, async waited, async left
    pending), destroys it and loads; then the world is destroyed too. Prints the threads and file
    descriptors left, to compare with the same job that never calls bcp (torch keeps a few of its own).

    The barrier is what a job's first collective on a group does, and the job without bcp needs it:
    ``dist.new_group`` returns on a rank once its own end of gloo's connection is up (torch has no
    barrier after creating a group unless ``TORCH_DIST_INIT_BARRIER=1``), so a rank destroying the
    group at once resets the connection while the peer may still be setting up its end, and the
    peer's ``new_group`` fails with "Connection closed by peer" (on a loaded machine, often).

    The counts are taken in a steady state every rank reaches: the job holds no reference to a
    destroyed group (torch closes a gloo group's sockets when its last reference goes; a loop that
    rebinds its variables drops them), every rank has settled, and none has left yet: a rank's exit
    closes its ends of the job's sockets, and a peer's gloo closes the other ends only when its own
    loop gets to it, so a count taken then would depend on how far the other rank had come."""
    rank, world = _join()
    state = _trained_state(world)
    for cycle in range(cycles):
        group = dist.new_group(list(range(world)))
        dist.barrier(group=group)
        if use_bcp:
            coordinator = bcp.TorchCoordinator(group)
            bcp.save(path, state, coordinator=coordinator)
            bcp.save(path, state, coordinator=coordinator, async_save=True).wait()
            bcp.save(path, state, coordinator=coordinator, async_save=True)  # destroy_process_group finishes it
            del coordinator
        dist.destroy_process_group(group)
        del group
        if use_bcp:
            assert bcp.load(path, state, coordinator=bcp.SingleProcessCoordinator()).generation == 3 * (cycle + 1)
    dist.destroy_process_group()
    meeting = f"{path}-ranks"
    _settled(settle_s)
    _every_rank_reached(meeting, "settled", rank, world)
    counts = _settled(settle_s)
    names = _thread_names()
    _every_rank_reached(meeting, "counted", rank, world)
    print(f"left: {counts[1]} {names!r}", flush=True)


def _every_rank_reached(folder: str, point: str, rank: int, world: int, timeout_s: float = 60.0) -> None:
    """A barrier through files, for when no process group is left: marks ``point`` reached by this
    rank, then waits for every rank's mark (an AssertionError naming the missing ranks after ``timeout_s``)."""
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, f"{point}-{rank}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while missing := [r for r in range(world) if not os.path.exists(os.path.join(folder, f"{point}-{r}"))]:
        assert time.monotonic() < deadline, f"rank(s) {missing} did not reach {point!r} within {timeout_s:g}s"
        time.sleep(0.02)


def _settled(settle_s: float) -> tuple[int, int]:
    """:func:`resources` once unchanged for ``settle_s`` (threads told to stop, bcp's and torch's,
    leave asynchronously; on a busy machine later than a fixed wait), at most 5 such waits."""
    seen = resources()
    for _ in range(5):
        time.sleep(settle_s)
        now = resources()
        if now == seen:
            break
        seen = now
    return seen


def _thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended while we looked
            pass
    return sorted(names)


def _plain_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 7))
    return {"model": model, "extra_state": None}


def _say_writer_process() -> None:
    print(f"writer process: {runtime().background.writer_pid()}", flush=True)


def writer_process_then_leave(path: str, how: str, destroy: bool) -> None:
    """Asynchronous saves through the writer process, the last one left pending; the script then
    ends ``how``. Prints the writer process's id, which must be gone once the rank has exited."""
    _, world = _join()
    state = _trained_state(world)
    bcp.save(path, state, async_save=True).wait()
    bcp.save(path, state, async_save=True)
    _say_writer_process()
    _leave(how, destroy)


def killed_while_the_writer_process_writes(path: str, writer_log: str) -> None:
    """A committed checkpoint, then a rank killed (SIGKILL, as by the OOM killer) while its writer
    process holds the job of an asynchronous save of a larger state: the writer process is stopped
    (SIGSTOP) before the job is handed to it, so the test, which lets it go on (SIGCONT), finds it
    with the job whatever the timing. The writer process's stderr goes to ``writer_log``-<rank>."""
    rank, world = _join()
    state = _trained_state(world)
    bcp.save(path, state)
    log = os.open(f"{writer_log}-{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    own_stderr = os.dup(2)
    os.dup2(log, 2)  # what the writer process inherits when the next save starts it
    bcp.save(path, state, async_save=True).wait()
    os.dup2(own_stderr, 2)
    os.kill(runtime().background.writer_pid(), signal.SIGSTOP)
    large = {"model": {f"w{i}": torch.randn(1 << 20) for i in range(16)}}
    bcp.save(path, large, async_save=True)
    _say_writer_process()
    os.kill(os.getpid(), signal.SIGKILL)
