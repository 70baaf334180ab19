"""Where bcp reads torch's tensors beyond their public API.

- ``Tensor._version``: the counter autograd raises at each in-place change, through which a save
  knows that a tensor it copied before is unchanged;
- ``UntypedStorage._swap_data_ptr_`` (torch 2.3 on): exchange two storages' memory, through which a
  load places a staged storage into the live one without a copy (without it every placement copies);
- ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: the box of a DTensor's
  global shape its local tensor holds.
"""

from __future__ import annotations

from typing import Any

import torch

from bcp.torch_internals import has_private_name, private_module, private_name


def version_counter(tensor: torch.Tensor) -> int:
    """The count of in-place changes made to ``tensor`` (and the tensors sharing its counter)."""
    return int(private_name(tensor, "_version"))


def can_exchange_storages() -> bool:
    """Whether :func:`exchange_storages` is there (else the caller copies)."""
    return has_private_name(torch.UntypedStorage, "_swap_data_ptr_")


def exchange_storages(live: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
    """Swap the memory of two storages of one size: ``live`` holds ``other``'s bytes after."""
    private_name(live, "_swap_data_ptr_")(other)


def local_shape_and_global_offset(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of the local tensor that ``dtensor``'s placements give this rank, and where it starts
    in the global tensor."""
    utils = private_module("torch.distributed.tensor._utils")
    compute = private_name(utils, "compute_local_shape_and_global_offset")
    shape, offset = compute(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    return tuple(shape), tuple(offset)
