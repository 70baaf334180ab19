"""Byte views of tensor memory, so I/O and checksums run on the tensor's own storage (no copy)."""

from __future__ import annotations

import torch


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as one contiguous CPU block: itself when it already is one, else a copy."""
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
