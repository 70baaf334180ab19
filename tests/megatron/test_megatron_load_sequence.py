"""A Megatron load runs bcp's one load sequence, on 2 gloo ranks with a real GPTModel: it is
transactional (a failure on one rank mid-read leaves every rank's model as it was), it takes
``read_once``, and it writes one metrics record beside the checkpoint.

Guards a past defect: the load strategy read straight into the ShardedTensors' data, so a load that
failed on one rank left the others' models overwritten, had no ``read_once`` and wrote no metrics."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import bcp_megatron
from bcp.api.metrics_log import read_records
from megatron_parts import gpt, parallel, raised, scramble


def _save(path: str, tp: int) -> None:
    from megatron.core import dist_checkpointing

    with parallel(tp=tp):
        model = gpt(seed=1, num_layers=2)
        dist_checkpointing.save(model.sharded_state_dict(), path, sharded_strategy=("bcp", 1))


def _load(path: str, tp: int, **strategy_options) -> tuple[tuple, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What loading raised, the model's state before and after (a scrambled fresh model)."""
    from megatron.core import dist_checkpointing

    with parallel(tp=tp):
        model = gpt(seed=2, num_layers=2)
        scramble(model)
        before = {name: tensor.clone() for name, tensor in model.state_dict().items() if torch.is_tensor(tensor)}
        strategy = bcp_megatron.BcpLoadShardedStrategy(**strategy_options)
        outcome = raised(lambda: dist_checkpointing.load(model.sharded_state_dict(), path, sharded_strategy=strategy))
        after = {name: tensor.clone() for name, tensor in model.state_dict().items() if torch.is_tensor(tensor)}
    return outcome, before, after


def _the_saved(path: str, tp: int) -> dict[str, torch.Tensor]:
    with parallel(tp=tp):
        model = gpt(seed=1, num_layers=2)
        return {name: tensor.clone() for name, tensor in model.state_dict().items() if torch.is_tensor(tensor)}


def _flip_a_byte(path: Path, rank: int) -> None:
    data = sorted(path.glob(f"gen-*/data/{rank:05d}-*.bin"))[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 + 3] ^= 0xFF  # one byte in the middle of the rank's data file
    data.write_bytes(bytes(raw))


def failing_on_rank_1(path: str) -> tuple[tuple, bool]:
    _save(path, tp=2)
    dist.barrier()
    if dist.get_rank() == 0:
        _flip_a_byte(Path(path), rank=1)
    dist.barrier()
    outcome, before, after = _load(path, tp=2)
    return outcome, all(torch.equal(before[name], after[name]) for name in before)


def test_a_load_failing_on_one_rank_leaves_every_ranks_model_unchanged(ranks, tmp_path):
    """At TP=2 each rank reads its own half of the model from its own data file; rank 1's has a
    flipped byte (a real damaged file, no mock). Rank 0 reads its share without fault, rank 1 finds
    the damage: both ranks raise, and neither rank's model changed."""
    outcomes = ranks(2).run(failing_on_rank_1, str(tmp_path))
    assert [unchanged for _, unchanged in outcomes] == [True, True]
    (on_0, _), (on_1, _) = outcomes
    assert on_0[:2] == on_1[:2] == (True, "CorruptCheckpointError"), outcomes
    assert "failed on 1 of 2 rank(s): rank 1: CorruptCheckpointError: checksum mismatch" in on_0[2]
    assert on_1[2].startswith("checksum mismatch in data/00001-")


def _load_records(path: str) -> list[dict]:
    return [record for record in read_records(path) if record["op"] == "load"]


def load_read_once(path: str) -> tuple[tuple, bool, int]:
    _save(path, tp=1)
    outcome, _, after = _load(path, tp=1, read_once=True)
    saved = _the_saved(path, tp=1)
    dist.barrier()
    received = sum(rank["received_bytes"] for record in _load_records(path) for rank in record["ranks"])
    return outcome, all(torch.equal(saved[name], after[name]) for name in saved), received


def test_read_once_through_the_strategy(ranks, tmp_path):
    """At DP=2 both ranks want the whole model: with ``read_once`` each byte is read from storage by
    one rank and received by the other (the metrics record counts the bytes received), and the
    model loads bitwise."""
    for outcome, bitwise, received in ranks(2).run(load_read_once, str(tmp_path)):
        assert outcome == ("nothing raised",)
        assert bitwise
        assert received > 0


def count_load_records(path: str) -> tuple[tuple, int]:
    _save(path, tp=2)
    dist.barrier()
    before = len(_load_records(path)) if dist.get_rank() == 0 else 0
    outcome, _, _ = _load(path, tp=2)
    dist.barrier()
    if dist.get_rank() != 0:
        return outcome, []
    return outcome, [[rank["rank"] for rank in record["ranks"]] for record in _load_records(path)[before:]]


def test_one_metrics_record_per_megatron_load(ranks, tmp_path):
    """The load adds exactly one record, holding both ranks, to the metrics log beside the checkpoint."""
    (outcome, added), (other, _) = ranks(2).run(count_load_records, str(tmp_path))
    assert outcome == other == ("nothing raised",)
    assert added == [[0, 1]]
