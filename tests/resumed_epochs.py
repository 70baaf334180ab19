"""What the resumed-epoch tests check, for loaders run by ``run_epochs`` functions that return, per
rank and per loader, the sample ids each epoch delivered (``ranks[rank][loader][epoch]``).

A run of 96 samples in batches of 4 on 2 ranks (12 batches per rank and epoch) saves after 5 batches
of epoch 0 (``e0b5``: 40 samples, no whole number of batches on 3 ranks), after the last batch of
epoch 0 (``e0b12``) and after 5 batches of epoch 2 (``e2b5``)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

import spawned_ranks

SIZE, BATCH, BEFORE = 96, 4, 5
SAVES = ((0, BEFORE), (0, SIZE // (2 * BATCH)), (2, BEFORE))
#: Each save of ``SAVES`` by name, with the first epoch a resume from it delivers samples of.
RESUMES = {f"e0b{BEFORE}": 0, f"e0b{SIZE // (2 * BATCH)}": 1, f"e2b{BEFORE}": 2}


def before(ranks: list, loader: str, epoch: int) -> list[int]:
    """Every rank's samples of ``epoch`` before a save after ``BEFORE`` batches."""
    return [i for rank in ranks for i in rank[loader][epoch][:BEFORE * BATCH]]


def assert_every_sample_once(ranks: list, loaders, epochs) -> None:
    for loader in loaders:
        for epoch in epochs:
            assert sorted(i for rank in ranks for i in rank[loader][epoch]) == list(range(SIZE)), (loader, epoch)


def assert_continues(saved: list, resumed: list, loaders, name: str, epochs: int = 3) -> None:
    """A resume from save ``name`` on the saving ranks delivers, on each rank, the uninterrupted run's
    rest of that epoch and its later epochs."""
    first = RESUMES[name]
    skip = BEFORE * BATCH if name.endswith(f"b{BEFORE}") else 0
    for loader in loaders:
        for rank, (mine, again) in enumerate(zip(saved, resumed)):
            expected = {first: mine[loader][first][skip:], **{e: mine[loader][e] for e in range(first + 1, epochs)}}
            assert again[loader] == expected, (name, loader, rank)


def assert_rest_once(saved: list, resumed: list, loaders, epoch: int) -> None:
    """The samples before a mid-epoch save and those a resume delivers are every sample once."""
    for loader in loaders:
        after = [i for rank in resumed for i in rank[loader][epoch]]
        assert sorted(before(saved, loader, epoch) + after) == list(range(SIZE)), (loader, epoch)


def resume_on_the_saving_ranks(run_epochs: Callable[..., Any], folder: str, saved: list, loaders) -> None:
    """Every save of ``RESUMES`` resumed on as many ranks as saved it continues each rank's uninterrupted run."""
    for name, first_epoch in RESUMES.items():
        resumed = spawned_ranks.run(len(saved), run_epochs, f"{folder}/again-{name}", 3, (), f"{folder}/{name}",
                                    first_epoch)
        assert_continues(saved, resumed, loaders, name)


def resume_on(ranks: int, run_epochs: Callable[..., Any], folder: str, saved: list, loaders, epoch: int) -> None:
    """The save after ``BEFORE`` batches of ``epoch`` resumed on ``ranks`` ranks: the rest of the epoch
    delivers every sample once, and the next epoch is a permutation of the dataset."""
    resumed = spawned_ranks.run(ranks, run_epochs, f"{folder}/on{ranks}-{epoch}", epoch + 2, (),
                                f"{folder}/e{epoch}b{BEFORE}", epoch)
    assert_rest_once(saved, resumed, loaders, epoch)
    assert_every_sample_once(resumed, loaders, [epoch + 1])


def from_more_ranks_to_fewer(run_epochs: Callable[..., Any], folder: str, saved_on: int, resumed_on: int,
                             loaders) -> None:
    """Saved after ``BEFORE`` batches on ``saved_on`` ranks, resumed on ``resumed_on``: the rest of the
    epoch delivers every sample once."""
    saved = spawned_ranks.run(saved_on, run_epochs, folder, 1, ((0, BEFORE),))
    resumed = spawned_ranks.run(resumed_on, run_epochs, f"{folder}/again", 1, (), f"{folder}/e0b{BEFORE}")
    assert_rest_once(saved, resumed, loaders, 0)


def uninterrupted_run(run_epochs: Callable[..., Any]) -> Any:
    """A module fixture: ``(folder, per-rank results)`` of three uninterrupted epochs on 2 ranks,
    saving at every save of ``SAVES`` into ``folder``."""

    @pytest.fixture(scope="module")
    def uninterrupted(tmp_path_factory: Any) -> tuple[str, list]:
        folder = str(tmp_path_factory.mktemp("uninterrupted"))
        return folder, spawned_ranks.run(2, run_epochs, folder, 3, SAVES)

    return uninterrupted
