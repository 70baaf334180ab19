"""Lightning's fit loop with a StatefulDataLoader train loader (2 read workers) under DDP with
BCPCheckpointIO, checkpointed mid-epoch on 2 processes and resumed to the end of the epoch on 2, 1
and 3: the samples trained on before the checkpoint and after the resume are every sample exactly
once, and on 2 processes each rank trains on the very samples of the uninterrupted run. With the
DistributedSampler Lightning puts in (which shuffles, seed 0: Lightning rebuilds torchdata's batch
sampler around it), with a shuffled loader (``shuffle=True``: Lightning wraps its RandomSampler,
which draws the epoch's permutation from its generator, in a DistributedSamplerWrapper), and with
bcp's sampler shuffled and in order (``use_distributed_sampler=False``).

The defects this guards: the plugin saved rank 0's loader state alone and every rank of a resume
on another number of processes skipped rank 0's count of its own shard, so samples were skipped
or repeated silently; a shuffled loader's resume drew another permutation from a generator that
had moved on, so samples were skipped and repeated silently on the same number of processes too."""

from __future__ import annotations

import pytest

from lightning_launch import run

pytestmark = pytest.mark.distributed

SAVED_AT, PER_RANK = 6, 48  # steps; 96 samples, batches of 4 on 2 processes: 12 steps an epoch
SETUPS = {"Lightning's DistributedSampler": (False, "lightning"), "a shuffled loader": (True, "lightning"),
          "bcp's sampler, shuffled": (True, "bcp"),
          "bcp's sampler, in order": (False, "bcp")}


def _fit(dirpath: str, setup: str, **args) -> dict:
    shuffle, sampler = SETUPS[setup]
    return {"case": "fit_ids", "args": {"dirpath": dirpath, "shuffle": shuffle, "sampler": sampler, **args}}


def _checkpoint(root: str, setup: str) -> str:
    return f"{root}/{setup}/step={SAVED_AT}.ckpt"


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """On 2 processes per setup: the uninterrupted epoch (saving at step 6), then a resume from step 6."""
    root = str(tmp_path_factory.mktemp("ids"))
    cases = [_fit(f"{root}/{setup}", setup, every=SAVED_AT) for setup in SETUPS]
    cases += [_fit(f"{root}/resumed", setup, resume_from=_checkpoint(root, setup)) for setup in SETUPS]
    return root, run(2, cases, f"{root}/launch-2")


def test_a_resume_on_two_processes_trains_on_the_uninterrupted_samples(first):
    root, per_rank = first
    for k, setup in enumerate(SETUPS):
        for rank in per_rank:
            uninterrupted, resumed = rank[k], rank[len(SETUPS) + k]
            assert len(uninterrupted) == PER_RANK
            assert resumed == uninterrupted[SAVED_AT * 4:], setup
        assert sorted(i for rank in per_rank for i in rank[k]) == list(range(96))


@pytest.mark.parametrize("processes", [1, 3])
def test_a_resume_on_another_number_of_processes_trains_on_every_sample_once(first, processes):
    root, saved = first
    resumed = run(processes, [_fit(f"{root}/on{processes}", setup, resume_from=_checkpoint(root, setup))
                              for setup in SETUPS], f"{root}/launch-{processes}")
    for k, setup in enumerate(SETUPS):
        before = [i for rank in saved for i in rank[k][:SAVED_AT * 4]]
        after = [i for rank in resumed for i in rank[k]]
        assert sorted(before + after) == list(range(96)), setup


def test_ranks_that_draw_different_permutations_are_refused(tmp_path):
    """Each rank's shuffled loader seeds its generator from its own global RNG: seeded per rank, the
    ranks cut their shards out of different permutations, which no checkpoint can resume exactly;
    the fit is refused on every rank as it sets its loader up, not checkpointed silently."""
    messages = run(2, [{"case": "fit_ids_error", "args": {"dirpath": str(tmp_path), "shuffle": True,
                                                          "sampler": "lightning", "seed": "per_rank"}}],
                   str(tmp_path / "launch"))
    for rank in messages:
        assert rank[0].startswith("CheckpointError: the train dataloader's RandomSampler has a different generator "
                                  "state on each rank")
