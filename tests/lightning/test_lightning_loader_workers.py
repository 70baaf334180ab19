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


def _resumes(root: str, saved: str, step: int, epochs: int, trainer=None, setups=tuple(SETUPS)) -> list[dict]:
    return [_fit(f"{root}/{saved}-{step}-{i}", setup, trainer and trainer(setup), epochs=epochs,
                 resume_from=f"{root}/{saved}/{i}/step={step}.ckpt") for i, setup in enumerate(SETUPS)
            if setup in setups]


def _epoch(per_rank: list, k: int, epoch: int) -> list[int]:
    return sorted(i for rank in per_rank for i in rank[k].get(epoch, []))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """On 2 processes per setup: three uninterrupted epochs, saving at steps 5, 12 and 29."""
    root = str(tmp_path_factory.mktemp("loaders"))
    cases = [_fit(f"{root}/2/{i}", setup, epochs=3, save_at=(BEFORE, PER_EPOCH, MID_EPOCH_2))
             for i, setup in enumerate(SETUPS)]
    return root, run(2, cases, f"{root}/launch-2")


def _before(saved_ranks: list, k: int, epoch: int = 0) -> list[int]:
    return [i for rank in saved_ranks for i in rank[k][epoch][:BEFORE * 4]]


def test_a_resume_on_two_processes_trains_on_the_uninterrupted_samples(saved):
    root, uninterrupted = saved
    cases = [case for step in (BEFORE, PER_EPOCH, MID_EPOCH_2) for case in _resumes(root, "2", step, 3)]
    resumed = run(2, cases, f"{root}/launch-2-again")
    for k, setup in enumerate(SETUPS):
        for epoch in range(3):
            assert _epoch(uninterrupted, k, epoch) == list(range(96)), (setup, epoch)
        for rank in range(2):
            mine = uninterrupted[rank][k]
            assert resumed[rank][k] == {0: mine[0][BEFORE * 4:], 1: mine[1], 2: mine[2]}, setup
            assert resumed[rank][len(SETUPS) + k] == {1: mine[1], 2: mine[2]}, setup  # from the end of epoch 0
            assert resumed[rank][2 * len(SETUPS) + k] == {2: mine[2][BEFORE * 4:]}, setup  # in epoch 2


@pytest.mark.parametrize("processes", [3, 4])
def test_a_resume_on_more_processes_trains_on_every_sample_once(saved, processes):
    root, uninterrupted = saved
    cases = _resumes(root, "2", BEFORE, 2)
    if processes == 3:
        cases += _resumes(root, "2", MID_EPOCH_2, 3)
    resumed = run(processes, cases, f"{root}/launch-{processes}")
    for k, setup in enumerate(SETUPS):
        assert sorted(_before(uninterrupted, k) + _epoch(resumed, k, 0)) == list(range(96)), setup
        assert _epoch(resumed, k, 1) == list(range(96)), setup
        if processes == 3:
            in_epoch_2 = _before(uninterrupted, k, 2) + _epoch(resumed, len(SETUPS) + k, 2)
            assert sorted(in_epoch_2) == list(range(96)), setup


def test_a_resume_on_one_process_trains_on_every_sample_once(saved):
    """With a single-device Trainer (and the plugin) and with a DDP strategy of one process."""
    root, uninterrupted = saved
    cases = _resumes(root, "2", BEFORE, 2, trainer=lambda setup: "single", setups=DISTRIBUTED_SAMPLER)
    cases += _resumes(root, "2", BEFORE, 2, setups=DISTRIBUTED_SAMPLER)
    resumed = run(1, cases, f"{root}/launch-1")
    count = len(DISTRIBUTED_SAMPLER)
    for k, setup in enumerate(DISTRIBUTED_SAMPLER):
        for index in (k, count + k):  # single device, then DDP of one process
            assert sorted(_before(uninterrupted, k) + _epoch(resumed, index, 0)) == list(range(96)), (setup, index)
            assert _epoch(resumed, index, 1) == list(range(96)), (setup, index)


@pytest.mark.parametrize("saved_on, resumed_on", [(4, 3), (3, 2)])
def test_a_resume_on_fewer_processes_trains_on_every_sample_once(tmp_path, saved_on, resumed_on):
    root = str(tmp_path)
    first = run(saved_on, [_fit(f"{root}/{saved_on}/{i}", setup, save_at=(BEFORE,), max_steps=BEFORE)
                           for i, setup in enumerate(SETUPS) if setup in DISTRIBUTED_SAMPLER],
                f"{root}/launch-{saved_on}")
    resumed = run(resumed_on, _resumes(root, str(saved_on), BEFORE, 1, setups=DISTRIBUTED_SAMPLER),
                  f"{root}/launch-{resumed_on}")
    for k, setup in enumerate(DISTRIBUTED_SAMPLER):
        assert sorted(_before(first, k) + _epoch(resumed, k, 0)) == list(range(96)), setup


def test_positions_of_rank_0_alone_resume_only_on_the_same_number_of_processes(tmp_path):
    """A checkpoint the plugin saved under Lightning's DDP without every rank's loader position (as a
    bcp_lightning that did not gather them saved it): on 2 processes every rank resumes from rank 0's,
    as Lightning's own engine does; on 3 the resume is refused, not guessed."""
    setup = "plugin, strategy='ddp', Lightning's sampler"
    run(2, [_fit(str(tmp_path), setup, save_at=(BEFORE,), max_steps=BEFORE, gather=False)], f"{tmp_path}/launch-2")
    resume = _fit(f"{tmp_path}/again", setup, resume_from=f"{tmp_path}/step={BEFORE}.ckpt")
    messages = run(3, [{**resume, "case": "fit_epochs_error"}], f"{tmp_path}/launch-3")
    for rank in messages:
        assert rank[0].startswith("MismatchError: train dataloader 0: the checkpoint holds the loader position of "
                                  "rank 0 alone of the 2 ranks that saved it")


def test_ranks_that_draw_different_permutations_are_refused(tmp_path):
    """Each rank's shuffled loader seeds its generator from its own global RNG: seeded per rank, the
    ranks cut their shards out of different permutations, which no checkpoint can resume exactly;
    the fit is refused on every rank as it sets its loader up, not checkpointed silently."""
    case = _fit(str(tmp_path), "plugin, strategy='ddp', a shuffled loader", seed="per_rank")
    messages = run(2, [{**case, "case": "fit_epochs_error"}], str(tmp_path / "launch"))
    for rank in messages:
        assert rank[0].startswith("CheckpointError: the train dataloader's RandomSampler has a different generator "
                                  "state on each rank")
