"""Which engine an accelerator's ``save_state``/``load_state`` use, and the switch that routes them.

Accelerate drops unknown keys of its config file and never sends the file to worker processes, but
every launcher (``accelerate launch``, ``torchrun``, SLURM) passes the environment on, so the flag
is an environment variable. It is read at each call, never cached at import: setting or clearing it
takes effect at the next ``save_state``/``load_state``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import accelerate

import bcp
from bcp import integration
from bcp_accelerate import dataloaders, generations, save_options
from bcp_accelerate import memory_tier as memory_tier_module
from bcp_accelerate.generations import DEFAULT_KEEP_GENERATIONS
from bcp_accelerate.engine_variable import ENGINE_VARIABLE

#: ``ENGINE_VARIABLE=bcp`` routes every accelerator through bcp; ``accelerate`` forces accelerate's own
#: engine even where the code opted in (a switch for operators); unset leaves the choice to the code.
ENGINES = ("bcp", "accelerate")

_OPTED_IN = "_bcp_checkpoint_engine"
_DISPATCHES = "_bcp_dispatches"


def requested_engine() -> str | None:
    """The engine named by ``ACCELERATE_CHECKPOINT_ENGINE``, or ``None`` when it is unset or empty."""
    return integration.requested_engine(ENGINE_VARIABLE, ENGINES)


def enable(accelerator: accelerate.Accelerator, *, keep_generations: int = DEFAULT_KEEP_GENERATIONS,
           memory_tier: "bcp.MemoryTier | None" = None, incremental: bool = False, async_save: bool = False,
           overlap: bool = False, compression: "bcp.Compression | str | bool | None" = None) -> accelerate.Accelerator:
    """Route this accelerator's ``save_state``/``load_state`` through bcp; returns it.
    ``keep_generations``: committed generations kept when ``save_state`` writes to a folder that
    already holds a checkpoint (a fixed ``output_dir``); each is a full copy of the state on disk,
    and ``load_state(folder, generation=N)`` loads an older one. ``memory_tier``: where
    ``save_state()`` and ``load_state()`` called without a folder go (a folder given still goes to
    that folder); ``save_state(tier)``/``load_state(tier)`` work without it. ``incremental``: a
    folder or tier saved again gets only the tensors that changed written (``docs/incremental.md``).
    ``async_save``: ``save_state`` into a tier returns once the state is staged in host memory and
    commits in the background; the next ``save_state``/``load_state`` waits for it to commit (and
    raises its failure). ``overlap`` (with ``async_save``): it returns before the parameters and
    optimizer state are copied; the prepared optimizers wait for the copy before they step
    (``docs/memory-tier.md``, "Checkpointing every step"). Folders are saved synchronously.
    ``compression``: ``"zstd"`` (or ``True``) compresses the tensors' bytes losslessly, in folders and
    tiers (``bcp.SaveOptions.compression``)."""
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"enable() takes an accelerate.Accelerator, got {type(accelerator).__name__}")
    generations.set_kept(accelerator, keep_generations)
    generations.set_incremental(accelerator, incremental)
    memory_tier_module.set_tier(accelerator, memory_tier)
    save_options.set_options(accelerator, async_save=async_save, overlap=overlap, compression=compression)
    install()
    setattr(accelerator, _OPTED_IN, True)
    return accelerator


def uses_bcp(accelerator: accelerate.Accelerator) -> bool:
    """Whether this accelerator's next ``save_state``/``load_state`` goes through bcp."""
    engine = requested_engine()
    if engine is not None:
        return engine == "bcp"
    return getattr(accelerator, _OPTED_IN, False)


def install() -> None:
    """Let ``accelerate.Accelerator.save_state``/``load_state`` consult :func:`uses_bcp` on each call
    (idempotent). While it says no, accelerate's own methods run, unchanged. The stateful
    dataloaders prepared from then on are followed (``dataloaders.install``)."""
    dataloaders.install()
    cls = accelerate.Accelerator
    if getattr(cls.save_state, _DISPATCHES, False):
        return
    save_state, load_state = cls.save_state, cls.load_state
    cls.save_state = _dispatching(save_state, memory_tier_module.save_state)
    # A folder written by accelerate's own engine is still loaded by it.
    cls.load_state = _dispatching(load_state, functools.partial(memory_tier_module.load_state,
                                                                accelerate_load_state=load_state))


def _dispatching(original: Callable[..., Any], through_bcp: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: accelerate.Accelerator, *args: Any, **kwargs: Any) -> Any:
        if uses_bcp(self):
            return through_bcp(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(method, _DISPATCHES, True)
    return method
