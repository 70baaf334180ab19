"""``--ckpt-format bcp`` for Megatron-LM's training scripts::

    torchrun --nproc-per-node 8 -m bcp_megatron.launch pretrain_gpt.py --ckpt-format bcp --save ... --load ...

Megatron-LM's ``--ckpt-format`` choices are a fixed ``Literal`` and its training loop compares
``ckpt_format == "torch_dist"`` in many places (which state dict to build, async saving, the
constant-structure cache, fully parallel save and load). So the launcher runs the script with
``--ckpt-format torch_dist`` - every distributed-checkpoint path of the loop - and routes that
path's saves to bcp's strategy. Loads follow each checkpoint's ``metadata.json``: bcp checkpoints
load through bcp, torch_dist ones through torch_dist, so a run can also switch format on resume.

Layouts: Megatron-LM 0.16 asks ``get_default_save_sharded_strategy`` for its save strategy (bcp's
is returned; loads dispatch on ``metadata.json`` through Megatron-Core's registry). Megatron-LM 0.17
builds ``TorchDistSaveShardedStrategy``, ``TorchDistLoadShardedStrategy`` and the fully parallel
wrapper by name: those names are bound to bcp's subclasses, whose load tells the formats apart.
"""

from __future__ import annotations

import os
import runpy
import sys
from types import ModuleType
from typing import Any

FORMAT = "bcp"
ROUTED_FORMAT = "torch_dist"
_FLAG = "--ckpt-format"


def rewrite_args(args: list[str]) -> tuple[list[str], bool]:
    """The script's arguments with ``--ckpt-format bcp`` replaced by ``torch_dist``, and whether
    bcp was asked for (the last ``--ckpt-format`` wins, as in argparse)."""
    out: list[str] = []
    requested = False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == _FLAG and i + 1 < len(args):
            requested = args[i + 1] == FORMAT
            out += [arg, ROUTED_FORMAT if requested else args[i + 1]]
            i += 2
            continue
        if arg.startswith(_FLAG + "="):
            requested = arg.split("=", 1)[1] == FORMAT
            arg = f"{_FLAG}={ROUTED_FORMAT}" if requested else arg
        out.append(arg)
        i += 1
    return out, requested


def install_routes(checkpointing: ModuleType) -> None:
    """Make ``megatron.training.checkpointing`` save its distributed checkpoints with bcp."""
    import bcp_megatron

    if hasattr(checkpointing, "get_default_save_sharded_strategy"):  # Megatron-LM 0.16

        def bcp_save_strategy(backend: str = ROUTED_FORMAT, version: int = 1) -> Any:
            return bcp_megatron.BcpSaveShardedStrategy()

        checkpointing.get_default_save_sharded_strategy = bcp_save_strategy
    elif hasattr(checkpointing, "TorchDistSaveShardedStrategy"):  # Megatron-LM 0.17
        from bcp_megatron.strategies_torch_dist import FullyParallelSaveStrategyWrapper

        checkpointing.TorchDistSaveShardedStrategy = bcp_megatron.BcpSaveShardedStrategy
        checkpointing.TorchDistLoadShardedStrategy = bcp_megatron.BcpLoadShardedStrategy
        checkpointing.FullyParallelSaveStrategyWrapper = FullyParallelSaveStrategyWrapper
    else:
        raise SystemExit("bcp_megatron.launch: this Megatron-LM's checkpointing module has neither the 0.16 nor "
                         "the 0.17 layout; save with dist_checkpointing and bcp_megatron's strategies directly")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script, *args = argv
    args, requested = rewrite_args(args)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` would
    if requested:
        try:
            import megatron.training.checkpointing as checkpointing
        except ImportError as exc:
            raise SystemExit(f"bcp_megatron.launch: --ckpt-format bcp routes Megatron-LM's training code, which "
                             f"does not import here ({exc}); run a script of a Megatron-LM checkout") from exc
        install_routes(checkpointing)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
