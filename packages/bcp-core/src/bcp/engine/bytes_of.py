"""Byte views of tensor memory, so I/O and checksums run on the tensor's own storage (no copy)."""

from __future__ import annotations

import torch

# dtypes numpy shares with torch: their bytes are viewed in one step, which matters when a state
# has thousands of small tensors; the others (bfloat16, float8, ...) are viewed as uint8 first.
_NUMPY_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.complex64, torch.complex128, torch.int64,
    torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
})


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as one contiguous CPU block: itself when it already is one, else a copy."""
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    if tensor.dtype in _NUMPY_DTYPES:
        return memoryview(tensor.numpy()).cast("B")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
