"""Byte views of tensor memory, so I/O and checksums run on the tensor's own storage (no copy)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as one contiguous CPU block: itself when it already is one, else a copy."""
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory; it keeps the tensor alive.

    Made from the tensor's address rather than through ``Tensor.numpy()``, which marks the storage
    as never to be resized again: bcp would otherwise leave that mark on every tensor it saves or
    loads, and a later load could no longer hand such a tensor its staged memory."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"byte_view needs a contiguous CPU tensor with its values in memory, not {tensor.device} "
                         f"{'contiguous' if tensor.is_contiguous() else 'strided'}"
                         f"{' conjugated' if tensor.is_conj() else ''}{' negated' if tensor.is_neg() else ''}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    memory = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    memory.owner = tensor  # the view holds ``memory``, which holds the tensor
    return memoryview(memory).cast("B")


def tensor_over(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over a flat byte view's memory, which it keeps alive, read-only memory included
    (the buffers a storage fetched), so that torch reads those bytes where they are, with no copy
    (``torch.frombuffer`` warns on read-only memory). Nothing may write through it."""
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    memory = (ctypes.c_ubyte * view.nbytes).from_address(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    memory.owner = view  # the tensor holds ``memory``, which holds the view and its buffer
    return torch.frombuffer(memory, dtype=torch.uint8)
