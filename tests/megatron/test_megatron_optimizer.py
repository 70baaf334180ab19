"""Megatron's DistributedOptimizer in its ``dp_reshardable`` format (1-D buckets cut into one
irregular piece per parameter and rank, ``axis_fragmentations=None``) saved at DP=2 and loaded at
DP=1: model and optimizer state bitwise, and the next step identical to the uninterrupted run."""

from __future__ import annotations

import bcp_megatron  # noqa: F401  (registers the 'bcp' backend)
from megatron_parts import (assemble, assert_bitwise, cpu_megatron_optimizer, distributed_optimizer, gpt,
                            load_model_and_optimizer, main_pieces, parallel, scramble, sharded_state, step)

DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}


def save_trained(path: str) -> tuple[list, list]:
    from megatron.core import dist_checkpointing

    with cpu_megatron_optimizer(), parallel():
        model = gpt(seed=1, num_layers=2)
        _, optimizer = distributed_optimizer(model)
        for seed in (0, 1):  # two steps, so that the saved Adam step differs from a fresh optimizer's
            step(model, optimizer, seed=seed)
        state = sharded_state(model, optimizer, DP_RESHARDABLE)
        dist_checkpointing.save(state, path, sharded_strategy=("bcp", 1))
        saved = main_pieces(state)
        step(model, optimizer, seed=2)
        return saved, main_pieces(model.sharded_state_dict())


def load_and_continue(path: str) -> tuple[list, list, list]:
    with cpu_megatron_optimizer(), parallel():
        model = gpt(seed=2, num_layers=2)
        _, optimizer = distributed_optimizer(model)
        scramble(model)
        load_model_and_optimizer(model, optimizer, path, DP_RESHARDABLE)
        state = sharded_state(model, optimizer, DP_RESHARDABLE)
        pieces = main_pieces(state)
        irregular = [v.key for v in _sharded_tensors(state) if v.axis_fragmentations is None]
        step(model, optimizer, seed=2)
        return pieces, main_pieces(model.sharded_state_dict()), irregular


def _sharded_tensors(state: dict) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(state) if isinstance(v, ShardedTensor)]


def test_dp_reshardable_dp2_to_dp1_bitwise(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    saved = ranks(2).run(save_trained, path)
    [(loaded, resumed, irregular)] = ranks(1).run(load_and_continue, path)
    assert irregular and all(".bucket_idx_" in key for key in irregular)
    assert_bitwise(assemble([pieces for pieces, _ in saved]), assemble([loaded]))
    assert_bitwise(assemble([after for _, after in saved]), assemble([resumed]))
