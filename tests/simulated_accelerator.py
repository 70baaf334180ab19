"""An accelerator for tests on the CPU: host copies stand in for device copies, so the pipelines
bcp builds on its accelerator interface (``bcp.engine.device_copies.Accelerator``) run here with
their real order, overlap and memory, only slower.

Its "device memory" is host memory: the tensors given to :meth:`SimulatedAccelerator.adopt` count as
on the device (by their storage), everything else as host memory. Its copy engine is one thread that
runs the copies in the order they were queued, as a device runs a stream: ``copy`` returns at once,
the landing's ``synchronize`` waits. Page-locking is bookkeeping. Each thing it is asked to do is
recorded in order (:attr:`events`), with the name of the thread that asked, and tests may add
their own events to the same record (:meth:`note`) to check what happened before what.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

QUEUED, COPIED, PINNED, REGISTERED = "queued", "copied", "pinned", "registered"
TO_HOST, TO_DEVICE = "to host", "to device"


@dataclass(frozen=True)
class Event:
    kind: str
    detail: str
    nbytes: int
    thread: str


class _Landing:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def synchronize(self) -> None:
        if not self._done.wait(30):
            raise TimeoutError("a simulated device copy did not land within 30 s")
        if self.error is not None:
            raise self.error


class SimulatedAccelerator:
    """See the module's docstring."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._device: dict[int, torch.Tensor] = {}  # storage address -> the tensor (kept: no address reuse)
        self._pinned: dict[int, int] = {}  # start address -> bytes of page-locked ranges
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._engine = threading.Thread(target=self._run, name="simulated-copy-engine", daemon=True)
        self._engine.start()

    def adopt(self, *tensors: torch.Tensor) -> None:
        """These tensors' memory is device memory from now on."""
        with self._lock:
            for tensor in tensors:
                self._device[tensor.untyped_storage().data_ptr()] = tensor

    def close(self) -> None:
        self._work.put(None)
        self._engine.join()

    def note(self, kind: str, detail: str = "", nbytes: int = 0) -> None:
        """Add an event of the test's own to the record."""
        with self._lock:
            self.events.append(Event(kind, detail, nbytes, threading.current_thread().name))

    def of(self, kind: str, detail: str | None = None) -> list[Event]:
        """The events of one kind (and detail), in order."""
        with self._lock:
            return [e for e in self.events if e.kind == kind and (detail is None or e.detail == detail)]

    # The accelerator interface.

    def holds(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in self._device

    def open_queue(self, device: torch.device) -> "_Queue":
        return _Queue(self)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self._pinned[buffer.data_ptr()] = nbytes
        self.note(PINNED, "allocated", nbytes)
        return buffer

    def is_pinned(self, host: torch.Tensor) -> bool:
        address = host.data_ptr()
        with self._lock:
            return any(start <= address < start + nbytes for start, nbytes in self._pinned.items())

    def register(self, host: torch.Tensor, device: torch.device) -> bool:
        nbytes = host.numel() * host.element_size()
        with self._lock:
            self._pinned[host.data_ptr()] = nbytes
        self.note(REGISTERED, "", nbytes)
        return True

    def unregister(self, host: torch.Tensor, device: torch.device) -> None:
        with self._lock:
            self._pinned.pop(host.data_ptr(), None)

    def pinned_bytes(self) -> int:
        """Bytes of host memory page-locked now (allocated pinned or registered)."""
        with self._lock:
            return sum(self._pinned.values())

    def _queue_copy(self, dest: torch.Tensor, source: torch.Tensor) -> _Landing:
        landing = _Landing()
        direction = TO_HOST if self.holds(source) else TO_DEVICE
        self.note(QUEUED, direction, dest.numel() * dest.element_size())
        self._work.put((dest, source, direction, landing))
        return landing

    def _run(self) -> None:
        while (job := self._work.get()) is not None:
            dest, source, direction, landing = job
            try:
                if dest is not None:
                    dest.copy_(source)
                    self.note(COPIED, direction, dest.numel() * dest.element_size())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for this copy
                landing.error = exc
            landing._done.set()


class _Queue:
    def __init__(self, accelerator: SimulatedAccelerator) -> None:
        self._accelerator = accelerator

    def copy(self, dest: torch.Tensor, source: torch.Tensor) -> _Landing:
        return self._accelerator._queue_copy(dest, source)

    def hand_over(self) -> None:
        # The host is this device's only consumer: it may use the tensors once every copy has run.
        landing = _Landing()
        self._accelerator._work.put((None, None, "", landing))
        landing.synchronize()
