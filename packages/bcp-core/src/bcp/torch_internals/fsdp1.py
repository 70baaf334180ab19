"""Where bcp reads FSDP1 (``FullyShardedDataParallel``) and ``nn.Module`` beyond their public API.

FSDP1's own ``state_dict`` all-gathers; bcp saves each rank's flat-parameter shard as it is, which
only FSDP's bookkeeping describes: a wrapper's flat-parameter handle, and for its flat parameter the
FQNs, shapes and shard ranges of the parameters it concatenates and the parameters it shares. A
module's buffers and which of them are not persistent have no public accessor that does not
all-gather under FSDP1 either.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch import nn

from bcp.torch_internals import private_name


def flat_handle(fsdp: Any) -> Any:
    """The ``FlatParamHandle`` of an FSDP1 wrapper (None for a wrapper with no parameters of its own)."""
    return private_name(fsdp, "_handle")


def uses_orig_params(handle: Any) -> bool:
    """Whether the wrapper was made with ``use_orig_params=True``."""
    return bool(private_name(handle, "_use_orig_params"))


def flat_parameters(flat: Any) -> Iterator[tuple[str, tuple[int, ...], Any]]:
    """``(fqn, shape, shard info)`` of each parameter a flat parameter concatenates; a shard info
    has ``in_shard``, ``offset_in_shard``, ``numel_in_shard`` and ``intra_param_start_idx``."""
    names, shapes = private_name(flat, "_fqns"), private_name(flat, "_shapes")
    return zip(names, shapes, private_name(flat, "_shard_param_infos"))


def shared_parameters(flat: Any) -> list[Any]:
    """The parameters a flat parameter holds under a second name: each with ``module_name``,
    ``param_name`` and the ``prim_module_name``/``prim_param_name`` it is the same tensor as."""
    return list(private_name(flat, "_shared_param_infos"))


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, buffer)`` of the module's own buffers that its state dict holds."""
    skipped = private_name(module, "_non_persistent_buffers_set")
    for name, buffer in private_name(module, "_buffers").items():
        if buffer is not None and name not in skipped:
            yield name, buffer
