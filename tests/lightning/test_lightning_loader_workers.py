"""Lightning's fit loop with a StatefulDataLoader train loader (2 read workers, 96 samples in batches
of 4), checkpointed through bcp_lightning and resumed on any number of processes: Lightning's plugin
under its own ``strategy="ddp"`` (whose checkpoint call happens on rank 0 alone) and
``BCPDDPStrategy``, with the DistributedSampler Lightning puts in (it shuffles, seed 0), with a
shuffled loader (``shuffle=True``: Lightning wraps its RandomSampler, which draws each epoch's
permutation from its generator, in a DistributedSamplerWrapper) and, on 2, 3 and 4 processes, with
bcp's sampler (``use_distributed_sampler=False``).

2 processes run three epochs uninterrupted, saving after 5 steps (40 samples: no whole number of
batches on 3 processes), after the last step of epoch 0 and after 5 steps of epoch 2. Resumed on 2,
each rank trains on the very samples of the uninterrupted run, in epoch 2 too, and the epoch after a
save at the end of one is the uninterrupted run's next epoch; on 1 (a single-device Trainer, and a
DDP strategy of one process), 3 and 4 processes the samples before the save and after it are every
sample of the epoch exactly once, and the next epoch is a permutation of the dataset. The same from
4 processes to 3 and from 3 to 2.

The launches are chained, each doing what the next needs (a Lightning job per number of processes:
2, 4, 3, 2 again, 1), and the tests read their parts of the results.

The defects this guards: the plugin saved rank 0's loader state alone, and every rank of a resume on
another number of processes (a single-device Trainer among them) skipped rank 0's count of its own
shard, so samples were skipped and repeated silently; another number of processes was refused
unless the consumed batches divided into whole batches per process; a resume in epoch >= 1 walked
epoch 0's order (Lightning sets the sampler's epoch after the loop first iterates the loader); a save
at the last step of an epoch resumed into an empty next epoch."""

from __future__ import annotations

import pytest

from lightning_launch import run

pytestmark = pytest.mark.distributed

PER_EPOCH = 12  # steps per epoch on 2 processes
BEFORE, MID_EPOCH_2 = 5, 2 * PER_EPOCH + 5
SETUPS = {  # saved with (trainer, shuffle, sampler)
    "plugin, strategy='ddp', Lightning's sampler": ("ddp", False, "lightning"),
    "plugin, strategy='ddp', a shuffled loader": ("ddp", True, "lightning"),
    "BCPDDPStrategy, Lightning's sampler": ("bcp_ddp", False, "lightning"),
    "BCPDDPStrategy, a shuffled loader": ("bcp_ddp", True, "lightning"),
    "plugin, strategy='ddp', bcp's sampler": ("ddp", True, "bcp"),
}
#: The setups resumed on one process and from more processes to fewer (bcp's sampler reshards by itself).
DISTRIBUTED_SAMPLER = [setup for setup in SETUPS if SETUPS[setup][2] == "lightning"]


def _fit(dirpath: str, setup: str, trainer: str | None = None, **args) -> dict:
    saved_with, shuffle, sampler = SETUPS[setup]
    return {"case": "fit_epochs", "args": {"dirpath": dirpath, "trainer": trainer or saved_with, "shuffle": shuffle,
                                           "sampler": sampler, **args}}


def _saves(root: str, world: int, setups) -> list[dict]:
    """On ``world`` processes: the first 5 steps of epoch 0 and a save after them, per setup."""
    return [_fit(f"{root}/{world}/{i}", setup, save_at=(BEFORE,), max_steps=BEFORE)
            for i, setup in enumerate(SETUPS) if setup in setups]


def _resumes(root: str, saved: int, step: int, epochs: int, trainer=None, setups=tuple(SETUPS)) -> list[dict]:
    return [_fit(f"{root}/{saved}-{step}-{i}", setup, trainer and trainer(setup), epochs=epochs,
                 resume_from=f"{root}/{saved}/{i}/step={step}.ckpt") for i, setup in enumerate(SETUPS)
            if setup in setups]


class Launches:
    """Runs the chained Lightning jobs and keeps each case's per-rank results under a name."""

    def __init__(self, root: str) -> None:
        self.root, self.results = root, {}

    def run(self, world: int, groups: dict[str, list[dict]]) -> None:
        cases = [case for group in groups.values() for case in group]
        per_rank = run(world, cases, f"{self.root}/launch-{len(self.results)}-{world}")
        start = 0
        for name, group in groups.items():
            self.results[name] = [rank[start:start + len(group)] for rank in per_rank]
            start += len(group)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("loaders"))
    jobs = Launches(root)
    plugin = "plugin, strategy='ddp', Lightning's sampler"
    jobs.run(2, {
        "uninterrupted": [_fit(f"{root}/2/{i}", setup, epochs=3, save_at=(BEFORE, PER_EPOCH, MID_EPOCH_2))
                          for i, setup in enumerate(SETUPS)],
        "ungathered": [_fit(f"{root}/ungathered", plugin, save_at=(BEFORE,), max_steps=BEFORE, gather=False)],
        "seeded per rank": [{**_fit(f"{root}/per-rank", "plugin, strategy='ddp', a shuffled loader",
                                    seed="per_rank"), "case": "fit_epochs_error"}],
    })
    jobs.run(4, {"2 -> 4": _resumes(root, 2, BEFORE, 2), "saved on 4": _saves(root, 4, DISTRIBUTED_SAMPLER)})
    ungathered = _fit(f"{root}/ungathered-again", plugin, resume_from=f"{root}/ungathered/step={BEFORE}.ckpt")
    jobs.run(3, {"2 -> 3": _resumes(root, 2, BEFORE, 2), "2 -> 3 in epoch 2": _resumes(root, 2, MID_EPOCH_2, 3),
                 "4 -> 3": _resumes(root, 4, BEFORE, 1, setups=DISTRIBUTED_SAMPLER),
                 "saved on 3": _saves(root, 3, DISTRIBUTED_SAMPLER),
                 "ungathered on 3": [{**ungathered, "case": "fit_epochs_error"}]})
    jobs.run(2, {**{f"2 -> 2 from {step}": _resumes(root, 2, step, 3) for step in (BEFORE, PER_EPOCH, MID_EPOCH_2)},
                 "3 -> 2": _resumes(root, 3, BEFORE, 1, setups=DISTRIBUTED_SAMPLER)})
    jobs.run(1, {"2 -> 1, single device": _resumes(root, 2, BEFORE, 2, trainer=lambda setup: "single",
                                                   setups=DISTRIBUTED_SAMPLER),
                 "2 -> 1, DDP": _resumes(root, 2, BEFORE, 2, setups=DISTRIBUTED_SAMPLER)})
    return jobs.results


def _epoch(per_rank: list, k: int, epoch: int) -> list[int]:
    return sorted(i for rank in per_rank for i in rank[k].get(epoch, []))


def _before(saved_ranks: list, k: int, epoch: int = 0) -> list[int]:
    return [i for rank in saved_ranks for i in rank[k][epoch][:BEFORE * 4]]


def test_a_resume_on_two_processes_trains_on_the_uninterrupted_samples(launches):
    uninterrupted = launches["uninterrupted"]
    for k, setup in enumerate(SETUPS):
        for epoch in range(3):
            assert _epoch(uninterrupted, k, epoch) == list(range(96)), (setup, epoch)
        for rank in range(2):
            mine = uninterrupted[rank][k]
            assert launches[f"2 -> 2 from {BEFORE}"][rank][k] == {0: mine[0][BEFORE * 4:], 1: mine[1], 2: mine[2]}
            assert launches[f"2 -> 2 from {PER_EPOCH}"][rank][k] == {1: mine[1], 2: mine[2]}, setup  # end of epoch 0
            assert launches[f"2 -> 2 from {MID_EPOCH_2}"][rank][k] == {2: mine[2][BEFORE * 4:]}, setup  # in epoch 2


@pytest.mark.parametrize("processes", [3, 4])
def test_a_resume_on_more_processes_trains_on_every_sample_once(launches, processes):
    uninterrupted, resumed = launches["uninterrupted"], launches[f"2 -> {processes}"]
    for k, setup in enumerate(SETUPS):
        assert sorted(_before(uninterrupted, k) + _epoch(resumed, k, 0)) == list(range(96)), setup
        assert _epoch(resumed, k, 1) == list(range(96)), setup
        if processes == 3:
            in_epoch_2 = _before(uninterrupted, k, 2) + _epoch(launches["2 -> 3 in epoch 2"], k, 2)
            assert sorted(in_epoch_2) == list(range(96)), setup


@pytest.mark.parametrize("trainer", ["single device", "DDP"])
def test_a_resume_on_one_process_trains_on_every_sample_once(launches, trainer):
    """With a single-device Trainer (and the plugin) and with a DDP strategy of one process."""
    uninterrupted, resumed = launches["uninterrupted"], launches[f"2 -> 1, {trainer}"]
    for k, setup in enumerate(DISTRIBUTED_SAMPLER):
        assert sorted(_before(uninterrupted, k) + _epoch(resumed, k, 0)) == list(range(96)), setup
        assert _epoch(resumed, k, 1) == list(range(96)), setup


@pytest.mark.parametrize("saved_on, resumed_on", [(4, 3), (3, 2)])
def test_a_resume_on_fewer_processes_trains_on_every_sample_once(launches, saved_on, resumed_on):
    saved, resumed = launches[f"saved on {saved_on}"], launches[f"{saved_on} -> {resumed_on}"]
    for k, setup in enumerate(DISTRIBUTED_SAMPLER):
        assert sorted(_before(saved, k) + _epoch(resumed, k, 0)) == list(range(96)), setup


def test_positions_of_rank_0_alone_resume_only_on_the_same_number_of_processes(launches):
    """A checkpoint the plugin saved under Lightning's DDP without every rank's loader position (as a
    bcp_lightning that did not gather them saved it) is refused on 3 processes, not guessed."""
    for rank in launches["ungathered on 3"]:
        assert rank[0].startswith("MismatchError: train dataloader 0: the checkpoint holds the loader position of "
                                  "rank 0 alone of the 2 ranks that saved it")


def test_ranks_that_draw_different_permutations_are_refused(launches):
    """Each rank's shuffled loader seeds its generator from its own global RNG: seeded per rank, the
    ranks cut their shards out of different permutations, which no checkpoint can resume exactly;
    the fit is refused on every rank as it sets its loader up, not checkpointed silently."""
    for rank in launches["seeded per rank"]:
        assert rank[0].startswith("CheckpointError: the train dataloader's RandomSampler has a different generator "
                                  "state on each rank")
