"""A real GPTModel saved through dist_checkpointing with bcp in one TP/PP layout and loaded in
another: every tensor is compared bitwise, whole, across the layouts (multi-process, gloo)."""

from __future__ import annotations

import json

import pytest

import bcp_megatron  # noqa: F401  (registers the 'bcp' backend)
from megatron_parts import assemble, assert_bitwise, gpt, main_pieces, parallel, scramble

LAYOUTS = {"tp2": (2, 1), "tp1": (1, 1), "pp2": (1, 2)}


def save_gpt(layout: str, path: str, tied: bool) -> list:
    from megatron.core import dist_checkpointing

    with parallel(*LAYOUTS[layout]):
        model = gpt(seed=1, tied=tied)
        dist_checkpointing.save(model.sharded_state_dict(), path, sharded_strategy=("bcp", 1))
        return main_pieces(model.sharded_state_dict())


def load_gpt(layout: str, path: str, tied: bool) -> list:
    from megatron.core import dist_checkpointing

    with parallel(*LAYOUTS[layout]):
        model = gpt(seed=2, tied=tied)
        scramble(model)
        loaded = dist_checkpointing.load(model.sharded_state_dict(), path)
        model.load_state_dict(loaded)
        return main_pieces(model.sharded_state_dict())


# Tied embeddings across pipeline stages need a CUDA all-reduce at construction: untied with PP.
@pytest.mark.parametrize("src,dst,tied", [("tp2", "tp1", True), ("tp1", "tp2", True), ("pp2", "tp1", False),
                                          ("tp2", "pp2", False)])
def test_gpt_reshards_bitwise(ranks, tmp_path, src, dst, tied):
    path = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()  # dist_checkpointing.save expects the directory (Megatron-LM creates it)
    saved = assemble(ranks(2).run(save_gpt, src, path, tied))
    loaded = assemble(ranks(2).run(load_gpt, dst, path, tied))
    assert_bitwise(saved, loaded)
    assert any(key.startswith("decoder.layers.") and value.shape[0] == 4 for key, value in saved.items())


def save_wrapped(path: str) -> list:
    """Megatron-LM wraps the save strategy in FullyParallelSaveStrategyWrapper by default."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    from bcp_megatron import BcpSaveShardedStrategy

    with parallel(*LAYOUTS["tp1"]):
        model = gpt(seed=1)
        strategy = FullyParallelSaveStrategyWrapper(BcpSaveShardedStrategy(),
                                                    parallel_state.get_data_parallel_group(with_context_parallel=True))
        dist_checkpointing.save(model.sharded_state_dict(), path, sharded_strategy=strategy)
        return main_pieces(model.sharded_state_dict())


def test_fully_parallel_wrapper_around_bcp(ranks, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    saved = assemble(ranks(2).run(save_wrapped, str(path)))
    assert json.loads((path / "metadata.json").read_text())["sharded_backend"] == "bcp"
    assert_bitwise(saved, assemble(ranks(2).run(load_gpt, "tp2", str(path), True)))
