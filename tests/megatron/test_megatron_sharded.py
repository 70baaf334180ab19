"""Hand-built sharded state dicts through dist_checkpointing with bcp (2 gloo ranks): regular grids,
layer-stacked (``prepend_axis_num``) and irregular 1-D ShardedTensors, replicas, ShardedObjects
(per element, on one rank only, a BytesIO), resharding on load, metadata, every StrictHandling
mode and the errors a user can meet."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

import bcp
import bcp.tools
import bcp_megatron
from bcp_megatron import BcpLoadShardedStrategy

REGULAR = torch.arange(48, dtype=torch.float32).reshape(8, 6)
STACKED = torch.arange(10, dtype=torch.bfloat16).reshape(2, 5)
FLAT = torch.arange(23, dtype=torch.float64) * 0.5
REPLICATED = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64)
# The irregular 1-D tensor's pieces: per rank, several (offset, length) runs, as the distributed
# optimizer cuts a bucket into one piece per parameter.
SAVE_RUNS = {0: [(0, 4), (4, 5)], 1: [(9, 14)]}
LOAD_RUNS = {0: [(0, 15)], 1: [(15, 8)]}
OBJECT = {(torch.float32, torch.float32): [9472], "lr": 1e-3, "betas": (0.9, 0.999)}


def sharded_state(rank: int, *, load: bool = False, runs: dict | None = None) -> dict:
    """Save layout: REGULAR split by rows, STACKED one layer per rank. Load layout: REGULAR split by
    columns, the ranks' layers swapped, other 1-D runs."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    runs = runs or (LOAD_RUNS if load else SAVE_RUNS)
    other = 1 - rank
    if load:
        regular = ShardedTensor.from_rank_offsets("test.regular", REGULAR[:, 3 * rank: 3 * rank + 3].clone(),
                                                  (1, rank, 2))
        stacked = ShardedTensor.from_rank_offsets("test.stacked", STACKED[other].clone(), (0, other, 2),
                                                  prepend_axis_num=1, replica_id=0)
    else:
        regular = ShardedTensor.from_rank_offsets("test.regular", REGULAR[4 * rank: 4 * rank + 4].clone(),
                                                  (0, rank, 2))
        stacked = ShardedTensor.from_rank_offsets("test.stacked", STACKED[rank].clone(), (0, rank, 2),
                                                  prepend_axis_num=1)
    state = {
        "regular": regular,
        "stacked": stacked,
        "flat": [ShardedTensor("optimizer.test.flat", FLAT[o: o + n].clone(), torch.float64, (n,), (23,), (o,),
                               axis_fragmentations=None) for o, n in runs[rank]],
        "replicated": ShardedTensor.from_rank_offsets("test.replicated", REPLICATED.clone(), replica_id=rank),
        "objects": {
            # one element of a 2-element object array per rank; on load each rank reads both
            "per_rank": [ShardedObject("test.per_rank", {"rank": r}, (2,), (r,), replica_id=0 if r == rank else 1)
                         for r in ((0, 1) if load else (rank,))],
            "optimizer": ShardedObject("optimizer.test.groups", OBJECT, (1,), (0,), replica_id=rank),
            "bytes": ShardedObject("test.bytes", io.BytesIO(b"te-extra-state"), (1,), (0,), replica_id=rank),
            "from_rank1": ShardedObject("test.from_rank1", torch.ones(3) * 7, (1,), (0,), replica_id=1 - rank),
        },
    }
    if load:
        for value in _tensors(state):
            value.data.fill_(-1)
    return state


def _tensors(state: dict) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(state) if isinstance(v, ShardedTensor)]


def save_case(path: str) -> None:
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state(dist.get_rank()), path, sharded_strategy=("bcp", 1))


def load_case(path: str) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sharded_state(dist.get_rank(), load=True), path)


def expected_load(rank: int) -> dict:
    return {
        "regular": REGULAR[:, 3 * rank: 3 * rank + 3],
        "stacked": STACKED[1 - rank],
        "flat": [FLAT[o: o + n] for o, n in LOAD_RUNS[rank]],
        "replicated": REPLICATED,
    }


def load_case_torch_dist_named(path: str) -> dict:
    """Through the strategy that stands in for torch_dist's by name (Megatron-LM 0.17 builds it
    itself; Megatron-Core's own tests ask for it with get_default_strategy)."""
    from megatron.core import dist_checkpointing

    from bcp_megatron.strategies_torch_dist import BcpLoadShardedStrategy as TorchDistNamed

    return dist_checkpointing.load(sharded_state(dist.get_rank(), load=True), path,
                                   sharded_strategy=TorchDistNamed())


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("megatron") / "ckpt"
    path.mkdir()
    ranks(2).run(save_case, str(path))
    return str(path)


def test_reshards_tensors_and_reads_objects_from_their_owner(ranks, saved):
    for rank, loaded in enumerate(ranks(2).run(load_case, saved)):
        expected = expected_load(rank)
        assert torch.equal(loaded["regular"], expected["regular"])
        assert torch.equal(loaded["stacked"], expected["stacked"]) and loaded["stacked"].dtype == torch.bfloat16
        assert all(torch.equal(a, b) for a, b in zip(loaded["flat"], expected["flat"]))
        assert torch.equal(loaded["replicated"], REPLICATED)
        objects = loaded["objects"]
        assert objects["per_rank"] == [{"rank": 0}, {"rank": 1}]
        assert objects["optimizer"] == OBJECT
        assert objects["bytes"].getvalue() == b"te-extra-state"
        assert torch.equal(objects["from_rank1"], torch.ones(3) * 7)


def test_the_strategy_named_like_torch_dists_loads_on_this_megatron_core(ranks, saved):
    """Guards a past defect: the strategy could not be built on Megatron-Core 0.16, because it passed
    0.17's ``cache_metadata`` option to 0.16's strategy, which takes none."""
    for rank, loaded in enumerate(ranks(2).run(load_case_torch_dist_named, saved)):
        expected = expected_load(rank)
        assert torch.equal(loaded["regular"], expected["regular"])
        assert torch.equal(loaded["stacked"], expected["stacked"])
        assert torch.equal(loaded["replicated"], expected["replicated"])


def test_metadata_without_process_group(saved):
    strategy = BcpLoadShardedStrategy()
    tensors = strategy.load_tensors_metadata(saved)
    assert {k: (v.global_shape, v.dtype) for k, v in tensors.items()} == {
        "test.regular": ((8, 6), torch.float32), "test.stacked": ((2, 5), torch.bfloat16),
        "optimizer.test.flat": ((23,), torch.float64), "test.replicated": ((5,), torch.int64)}
    everything = strategy.load_sharded_metadata(saved)
    objects = {k for k, v in everything.items() if k not in tensors}
    assert objects == {"test.per_rank/shard_0_2", "test.per_rank/shard_1_2", "optimizer.test.groups/shard_0_1",
                       "test.bytes/shard_0_1", "test.from_rank1/shard_0_1"}


def test_bcp_tools_read_verify_and_export_under_megatron_names(saved, tmp_path):
    from safetensors.torch import load_file

    checkpoint = bcp.tools.open_checkpoint(saved)
    assert checkpoint.manifest.framework == "megatron"
    assert torch.equal(checkpoint.read("optimizer/optimizer.test.flat"), FLAT)
    assert bcp.tools.verify_checkpoint(saved).ok
    bcp.tools.export_safetensors(saved, tmp_path / "out")
    exported = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
    assert exported.keys() == {"test.regular", "test.stacked", "test.replicated"}
    assert torch.equal(exported["test.regular"], REGULAR) and torch.equal(exported["test.stacked"], STACKED)


def strict_modes(path: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling

    outcomes = {}
    for mode in StrictHandling:
        state = sharded_state(dist.get_rank(), load=True)
        del state["replicated"]  # saved but not asked for: "missing"
        state["absent"] = ShardedTensor.from_rank_offsets("test.absent", torch.zeros(2),  # asked for, not saved
                                                          replica_id=dist.get_rank())
        try:
            result = dist_checkpointing.load(state, path, strict=mode)
        except Exception as exc:  # the outcome under test
            outcomes[mode.name] = ("raised", type(exc).__name__, str(exc))
            continue
        if isinstance(result, tuple):
            loaded, missing, unexpected = result
            outcomes[mode.name] = ("returned", sorted(missing), sorted(unexpected), "absent" in loaded)
        else:
            outcomes[mode.name] = ("loaded", torch.equal(result["regular"], expected_load(dist.get_rank())["regular"]),
                                   "absent" in result)
    return outcomes


def test_every_strict_mode(ranks, saved):
    outcomes = ranks(2).run(strict_modes, saved)
    assert outcomes[0].keys() == outcomes[1].keys()
    result = outcomes[0]
    kind, name, message = result["ASSUME_OK_UNEXPECTED"]
    assert (kind, name) == ("raised", "MismatchError") and "test.absent" in message and "LOG_UNEXPECTED" in message
    for mode in ("RAISE_UNEXPECTED", "RAISE_ALL"):
        assert result[mode][:2] == ("raised", "CheckpointingException") and "test.absent" in result[mode][2]
    assert "test.replicated" in result["RAISE_ALL"][2]
    assert result["RETURN_UNEXPECTED"] == ("returned", [], ["test.absent"], False)
    assert result["RETURN_ALL"] == ("returned", ["test.replicated"], ["test.absent"], False)
    for mode in ("LOG_UNEXPECTED", "LOG_ALL", "IGNORE_ALL"):
        assert result[mode] == ("loaded", True, False)


def mismatches(path: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    rank = dist.get_rank()
    outcomes = {}
    cases = {
        "dtype": ShardedTensor.from_rank_offsets("test.replicated", torch.zeros(5, dtype=torch.int32), replica_id=rank),
        "shape": ShardedTensor.from_rank_offsets("test.replicated", torch.zeros(6, dtype=torch.int64), replica_id=rank),
        "grown": ShardedTensor.from_rank_offsets("test.replicated", torch.full((7,), -1, dtype=torch.int64),
                                                 replica_id=rank, allow_shape_mismatch=True),
        "no data": ShardedTensor.from_rank_offsets("test.replicated", REPLICATED, replica_id=rank).without_data(),
    }
    strict = BcpLoadShardedStrategy(cast_dtype=False)
    for case, request in [*cases.items(), ("strict dtype", cases["dtype"])]:
        try:
            loaded = dist_checkpointing.load({"t": request}, path, strict if case == "strict dtype" else None)["t"]
            outcomes[case] = (loaded.dtype, loaded.tolist())
        except bcp.CheckpointError as exc:
            outcomes[case] = f"{type(exc).__name__}: {exc}"
    return outcomes


def test_mismatches_fail_clearly_or_fit_when_allowed(ranks, saved):
    outcome = ranks(2).run(mismatches, saved)[0]
    assert outcome["dtype"] == (torch.int32, [3, 1, 4, 1, 5])  # cast, as Megatron's torch_dist does
    assert outcome["strict dtype"].startswith("MismatchError") and "int64" in outcome["strict dtype"]
    assert "int32" in outcome["strict dtype"] and "test.replicated" in outcome["strict dtype"]
    assert outcome["shape"].startswith("MismatchError") and "[5]" in outcome["shape"]
    assert outcome["grown"] == (torch.int64, [3, 1, 4, 1, 5, 0, 0])
    assert outcome["no data"] == (torch.int64, [3, 1, 4, 1, 5])


def save_with_flattened_range(path: str) -> None:
    """Megatron <= 0.15 cuts a chunk further with ``flattened_range`` (0.16 refuses to build such a
    ShardedTensor, so one is set up by hand, as 0.15 would hand it to the strategy)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    rank = dist.get_rank()
    chunk = REGULAR[4 * rank: 4 * rank + 4]  # rows of the 8x6 tensor, flattened and cut in two uneven parts
    pieces = []
    for start, stop in ((0, 7), (7, 24)):
        piece = ShardedTensor.from_rank_offsets("test.regular", chunk.clone(), (0, rank, 2))
        piece.flattened_range = slice(start, stop)
        piece.data = chunk.reshape(-1)[start:stop].clone()
        pieces.append(piece)
    bcp_megatron.BcpSaveShardedStrategy().save({"regular": pieces}, path)


def load_regular(path: str) -> torch.Tensor:
    from megatron.core.dist_checkpointing import ShardedTensor

    rank = dist.get_rank()
    request = ShardedTensor.from_rank_offsets("test.regular", torch.zeros(8, 3), (1, rank, 2))
    return BcpLoadShardedStrategy().load({"t": request}, path)["t"]


def test_flattened_range_pieces_of_megatron_015(ranks, tmp_path):
    ranks(2).run(save_with_flattened_range, str(tmp_path))
    for rank, loaded in enumerate(ranks(2).run(load_regular, str(tmp_path))):
        assert torch.equal(loaded, REGULAR[:, 3 * rank: 3 * rank + 3])


def save_with_gap(path: str) -> str:
    try:
        bcp_megatron.BcpSaveShardedStrategy().save(sharded_state(dist.get_rank(), runs={0: [(0, 4), (5, 4)],
                                                                                       1: [(8, 15)]}), path)
    except bcp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_irregular_pieces_with_a_gap_hidden_by_an_overlap_are_refused(ranks, tmp_path):
    # [0, 4) + [5, 9) + [8, 23): the volume is right, Megatron does not check irregular pieces.
    for outcome in ranks(2).run(save_with_gap, str(tmp_path)):
        assert outcome.startswith("MismatchError") and "offsets [4] with lengths [1] are held by no shard" in outcome


def save_logging_at_info(path: str) -> list[tuple[str, int]]:
    """A save through Megatron with the root logger at INFO (as Megatron-LM's training module sets
    it): what reached the root's handlers, as Megatron-Core's test_exact_load_handling sees it."""
    import logging

    from megatron.core import dist_checkpointing

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, int]] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.seen.append((record.name, record.levelno))

    root, kept = logging.getLogger(), Kept()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(kept)
    try:
        dist_checkpointing.save(sharded_state(dist.get_rank()), path, sharded_strategy=("bcp", 1))
    finally:
        root.removeHandler(kept)
        root.setLevel(level)
    return [seen for seen in kept.seen if seen[0].startswith("bcp")]


def test_a_save_logs_its_summary_at_debug_as_megatron_core_does(ranks, tmp_path):
    """Guards a past defect: bcp-megatron's saves logged bcp's summary line at INFO, so under Megatron-LM
    (which sets the root logger to INFO) rank 0 failed Megatron-Core's "nothing logged" checks alone."""
    assert ranks(2).run(save_logging_at_info, str(tmp_path)) == [[], []]


def save_with_metrics(path: str) -> list | None:
    from megatron_parts import parallel

    with parallel(tp=2):
        strategy = bcp_megatron.BcpSaveShardedStrategy()
        handle = strategy.saver.save(sharded_state(dist.get_rank()), path, async_save=False)
    metrics = handle.metrics  # rank 0 holds the operation's record
    return None if metrics is None else [rank.topology for rank in metrics.ranks]


def test_saves_carry_megatrons_parallel_coordinates_into_the_metrics(ranks, tmp_path):
    topologies = ranks(2).run(save_with_metrics, str(tmp_path))[0]
    assert topologies == [{"dp": 0, "tp": 0, "pp": 0, "ep": 0}, {"dp": 0, "tp": 1, "pp": 0, "ep": 0}]


def save_twice(path: str, keep_generations: int) -> None:
    from megatron.core import dist_checkpointing

    state = sharded_state(dist.get_rank())
    strategy = bcp_megatron.BcpSaveShardedStrategy(keep_generations=keep_generations)
    dist_checkpointing.save(state, path, sharded_strategy=strategy)
    for tensor in _tensors(state):
        tensor.data.add_(1)
    dist_checkpointing.save(state, path, sharded_strategy=strategy)


@pytest.mark.parametrize("keep", [1, 2])
def test_a_folder_saved_again_keeps_the_generations_asked_for(ranks, tmp_path, keep):
    from bcp.integration import checkpoint_location

    path = tmp_path / "ckpt"
    path.mkdir()
    ranks(2).run(save_twice, str(path), keep)
    location = checkpoint_location(str(path), None)
    kept = [g for g in location.generations() if location.is_committed(g)]
    assert len(kept) == keep
    assert torch.equal(bcp.tools.open_checkpoint(str(path)).read("model/test.regular"), REGULAR + 1)
    if keep == 2:
        older = bcp.tools.open_checkpoint(str(path), generation=kept[0])
        assert torch.equal(older.read("model/test.regular"), REGULAR)


def save_incrementally(path: str) -> list[int]:
    """Three saves into one folder with ``incremental=True``: every tensor changed behind torch's
    version counter (``.data``), then nothing changed."""
    from megatron.core import dist_checkpointing

    state = sharded_state(dist.get_rank())
    strategy = bcp_megatron.BcpSaveShardedStrategy(incremental=True)
    dist_checkpointing.save(state, path, sharded_strategy=strategy)
    for tensor in _tensors(state):
        tensor.data.add_(1)
    dist_checkpointing.save(state, path, sharded_strategy=strategy)
    dist_checkpointing.save(state, path, sharded_strategy=strategy)
    return [bcp.tools.open_checkpoint(path, generation=g).manifest.version for g in (2, 3)]


def test_incremental_saves_of_a_folder_write_what_changed_behind_the_version_counter(ranks, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    versions = ranks(2).run(save_incrementally, str(path))[0]
    assert versions == [1, 3]  # the second save wrote everything again, the third nothing
    assert torch.equal(bcp.tools.open_checkpoint(str(path)).read("model/test.regular"), REGULAR + 1)
