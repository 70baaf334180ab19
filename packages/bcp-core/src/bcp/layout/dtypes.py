"""Names of tensor dtypes as they appear in the manifest (``"float32"``, ``"bfloat16"``, ...)."""

from __future__ import annotations

import torch

_BY_NAME: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}
# Canonical names: the one ``str(dtype)`` prints, so aliases (``float``, ``half``) never reach a file.
_NAME_OF: dict[torch.dtype, str] = {value: str(value).removeprefix("torch.") for value in _BY_NAME.values()}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAME_OF[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a manifest name; ``KeyError`` for anything that is not a dtype of torch."""
    dtype = _BY_NAME.get(name)
    if dtype is None or _NAME_OF[dtype] != name:
        raise KeyError(name)
    return dtype


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def exponent_bits(dtype: torch.dtype) -> int:
    """Exponent bits of a floating-point or complex dtype's real elements (0: an integer or bool
    dtype, or a float8 dtype, whose chunks are not coded in planes)."""
    return _EXPONENT_BITS.get(dtype, 0)


_EXPONENT_BITS = {torch.float16: 5, torch.bfloat16: 8, torch.float32: 8, torch.float64: 11, torch.complex64: 8,
                  torch.complex128: 11}


def plane_width(dtype: torch.dtype) -> int:
    """Bytes per real element of a floating-point or complex dtype (the byte planes a compressed
    chunk of it is coded in, ``chunk_codecs.ZSTD_PLANES``), else 1."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return 1
    return itemsize(dtype) // 2 if dtype.is_complex else itemsize(dtype)
