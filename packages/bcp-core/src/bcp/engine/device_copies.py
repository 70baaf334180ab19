"""What bcp asks of an accelerator: which tensors live in its memory, queues of asynchronous copies
between its memory and the host's, and page-locked (pinned) host memory, which those copies need to
run as DMA at the bus's speed.

The runtime holds one :class:`Accelerator`. :class:`TorchAccelerator` is torch's current accelerator
(CUDA, ROCm, XPU alike, through ``torch.accelerator``, ``torch.Stream`` and ``torch.Event``); on a
machine without one it holds no tensor and nothing here runs. The pipelines built on it
(``chunked_copies``) see only this interface, so a test can give the runtime an accelerator whose
"device memory" is host memory and whose copy engine is a thread, and check their logic on the CPU.

Copies run on a stream of bcp's own, ordered against the stream that produces (or consumes) the
tensors by events, never by a device-wide synchronize: training's queued kernels keep running while
the copies wait only for what they need.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

# cudaHostRegisterPortable: page-locked for every CUDA context of the process, not only the one
# current at the call.
_REGISTER_PORTABLE = 1


class Landing(Protocol):
    """A queued copy (or the last of several queued in order); a ``torch.Event`` is one."""

    def synchronize(self) -> None:
        """Block until the copy is complete."""


class CopyQueue(Protocol):
    """Asynchronous copies between one device and host memory, run in the order they are queued,
    after the work the device's current stream had queued when the queue was opened. Several
    threads may queue copies at once."""

    def copy(self, dest: torch.Tensor, source: torch.Tensor) -> Landing:
        """Queue ``dest.copy_(source)``: device to host or host to device. It runs asynchronously
        where the host side is pinned; the host memory must stay untouched until it has landed."""

    def hand_over(self) -> None:
        """The stream that was current when the queue was opened waits for every copy queued so far
        before its next work: device tensors written by the copies are then safe to use there."""


class Accelerator(Protocol):
    """The accelerator of a process, as bcp uses it."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in this accelerator's memory."""

    def open_queue(self, device: torch.device) -> CopyQueue:
        """A queue of copies on ``device``, ordered after the work its current stream holds now
        (call it on the thread that produced the tensors, or will consume them)."""

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked host buffer of ``nbytes`` bytes (uint8)."""

    def is_pinned(self, host: torch.Tensor) -> bool:
        """Whether ``host`` lies in page-locked memory (copies to and from it are DMA)."""

    def register(self, host: torch.Tensor, device: torch.device) -> bool:
        """Page-lock host memory allocated elsewhere (shared memory, a plain allocation) for copies
        with ``device``, as if it had been allocated pinned; False where the accelerator cannot, an
        error where it failed. Slow: about a second per few GB. Any thread may call it."""

    def unregister(self, host: torch.Tensor, device: torch.device) -> None:
        """Undo :meth:`register`, before the memory is freed."""


class TorchAccelerator:
    """Torch's current accelerator, or none: where torch has none, it holds no tensor. Nothing here
    touches the device before a tensor in its memory is met (a forked child may construct one)."""

    def __init__(self) -> None:
        self._type: str | None = None
        self._known = False
        self._streams: dict[torch.device, torch.Stream] = {}
        self._lock = threading.Lock()

    def holds(self, tensor: torch.Tensor) -> bool:
        # ``is_cpu`` first: asked for every tensor a save writes, and ``device`` makes an object
        return not tensor.is_cpu and tensor.device.type == self._device_type()

    def open_queue(self, device: torch.device) -> CopyQueue:
        return _StreamQueue(self._stream(device), torch.accelerator.current_stream(device))

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, host: torch.Tensor) -> bool:
        return self._device_type() is not None and host.is_pinned()

    def register(self, host: torch.Tensor, device: torch.device) -> bool:
        # Only CUDA's driver page-locks memory it did not allocate: elsewhere the memory stays
        # pageable (copies through it still work, through pinned chunks). On the device the copies
        # use: a thread's default device (0) would get a context of its own on every rank.
        if host.numel() == 0 or self._device_type() != "cuda":
            return False
        nbytes = host.numel() * host.element_size()
        with torch.cuda.device(device):
            error = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, _REGISTER_PORTABLE))
        if error:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {error}")
        return True

    def unregister(self, host: torch.Tensor, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())

    def _device_type(self) -> str | None:
        if not self._known:
            accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            self._type, self._known = (accelerator.type if accelerator is not None else None), True
        return self._type

    def _stream(self, device: torch.device) -> torch.Stream:
        """bcp's copy stream on ``device``, made once per device."""
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.Stream(device=device)
            return stream


class _StreamQueue:
    """Copies on bcp's copy stream, which starts after the producer's work queued so far."""

    def __init__(self, stream: torch.Stream, producer: torch.Stream) -> None:
        stream.wait_stream(producer)
        self._stream = stream
        self._producer = producer

    def copy(self, dest: torch.Tensor, source: torch.Tensor) -> Landing:
        with self._stream:
            dest.copy_(source, non_blocking=True)
        return self._stream.record_event()

    def hand_over(self) -> None:
        self._producer.wait_event(self._stream.record_event())
