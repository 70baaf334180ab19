"""Copies between accelerator memory and pinned host memory on a side stream of bcp's own, ordered
against the stream that produces (or consumes) the tensors by events, never by a device-wide
synchronize: training's queued kernels keep running while the copies wait only for what they need.

Device-generic (``torch.accelerator``, ``torch.Stream``, ``torch.Event``): CUDA, ROCm, XPU alike.
CPU tensors never come here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source)

_streams: dict[torch.device, torch.Stream] = {}
_lock = threading.Lock()


def copy_stream(device: torch.device) -> torch.Stream:
    """bcp's copy stream on ``device``, created once per process and device."""
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.Stream(device=device)
        return stream


def to_host(pairs: Iterable[Pair]) -> None:
    """Copy accelerator tensors into pinned host tensors; returns once the bytes are on the host.

    Each device's copies start after the work its current stream has queued so far (the producer
    of the tensors), and only those copies are waited for."""
    for device, group in _by_device(pairs, source_side=True).items():
        done = _copy_after(device, group)
        done.synchronize()


def to_device(pairs: Iterable[Pair]) -> None:
    """Copy pinned host tensors into accelerator tensors. The copies start after the work each
    device's current stream has queued so far (which may still read the old values); that stream
    waits for them before its next work; returns once the host buffers may be reused."""
    for device, group in _by_device(pairs, source_side=False).items():
        done = _copy_after(device, group)
        torch.accelerator.current_stream(device).wait_event(done)
        done.synchronize()


def _copy_after(device: torch.device, pairs: list[Pair]) -> torch.Event:
    producer = torch.accelerator.current_stream(device)
    stream = copy_stream(device)
    stream.wait_stream(producer)
    with stream:
        for dest, source in pairs:
            dest.copy_(source, non_blocking=True)
    return stream.record_event()


def _by_device(pairs: Iterable[Pair], *, source_side: bool) -> dict[torch.device, list[Pair]]:
    groups: dict[torch.device, list[Pair]] = {}
    for dest, source in pairs:
        device = source.device if source_side else dest.device
        groups.setdefault(device, []).append((dest, source))
    return groups


def is_accelerator(tensor: torch.Tensor) -> bool:
    """Whether the tensor lives in accelerator memory (the copies above apply to it)."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and tensor.device.type == accelerator.type


def pin_host() -> bool:
    """Whether host buffers should be pinned: an accelerator is present to copy to and from."""
    return torch.accelerator.is_available()


def register_pinned(host: torch.Tensor) -> bool:
    """Page-lock memory torch did not allocate (shared memory), as ``pin_memory`` would, so copies
    from the device into it are asynchronous DMA; returns whether it was registered. Only CUDA's
    driver offers this for foreign memory: elsewhere the memory stays pageable (copies still work,
    as synchronous ones)."""
    if host.numel() == 0 or not torch.cuda.is_available():
        return False
    return int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)) == 0


def unregister_pinned(host: torch.Tensor) -> None:
    """Undo :func:`register_pinned` before the memory is unmapped."""
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
