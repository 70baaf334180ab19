"""``BcpSaveShardedStrategy(compression="zstd")``: a GPT with the DistributedOptimizer saved through
``dist_checkpointing.save`` is compressed (format version 4, fewer bytes stored than held), and
loaded through the ``bcp`` backend (which reads either kind) into a fresh, scrambled model its
model and optimizer state are bitwise the saved ones and the next step is the uninterrupted run's."""

from __future__ import annotations

import bcp_megatron
from compressed import assert_compressed
from megatron_parts import (assemble, assert_bitwise, cpu_megatron_optimizer, distributed_optimizer, gpt,
                            load_model_and_optimizer, main_pieces, parallel, scramble, sharded_state, step)

FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def save_load_and_continue(path: str) -> tuple[list, list, list, list]:
    from megatron.core import dist_checkpointing

    with cpu_megatron_optimizer(), parallel():
        model = gpt(seed=1, num_layers=2)
        _, optimizer = distributed_optimizer(model)
        for seed in (0, 1):
            step(model, optimizer, seed=seed)
        state = sharded_state(model, optimizer, FULLY_RESHARDABLE)
        dist_checkpointing.save(state, path, sharded_strategy=bcp_megatron.BcpSaveShardedStrategy(compression="zstd"))
        saved = main_pieces(state)
        step(model, optimizer, seed=2)
        uninterrupted = main_pieces(model.sharded_state_dict())
    with cpu_megatron_optimizer(), parallel():
        model = gpt(seed=2, num_layers=2)
        _, optimizer = distributed_optimizer(model)
        scramble(model)
        load_model_and_optimizer(model, optimizer, path, FULLY_RESHARDABLE)
        loaded = main_pieces(sharded_state(model, optimizer, FULLY_RESHARDABLE))
        step(model, optimizer, seed=2)
        return saved, loaded, uninterrupted, main_pieces(model.sharded_state_dict())


def test_a_compressed_checkpoint_loads_bitwise(ranks, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    [(saved, loaded, uninterrupted, resumed)] = ranks(1).run(save_load_and_continue, str(path))
    assert_compressed(path)
    assert_bitwise(assemble([saved]), assemble([loaded]))
    assert_bitwise(assemble([uninterrupted]), assemble([resumed]))
