"""The resumed-epoch runs shared by the bare ``DataloaderState`` and Accelerate tests, and what they check.

A test module defines ``run_epochs(folder, epochs, saves, resume_from, first_epoch)``, which runs its
loaders on the calling gloo rank and returns, per loader, the sample ids each epoch delivered to it.
:func:`chained_runs` runs them as a chain of jobs on 2, 4, 3, 2 and 1 ranks, each job list in one set
of freshly spawned ranks: 96 samples in batches of 4; 2 ranks run three epochs uninterrupted (12
batches per rank and epoch), saving after 5 batches of epoch 0 (``e0b5``: 40 samples, no whole number
of batches on 3 ranks), after the last batch of epoch 0 (``e0b12``) and after 5 batches of epoch 2
(``e2b5``); then the resumes, and saves on 4 and 3 ranks for the resumes from more ranks to fewer.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

import spawned_ranks

SIZE, BATCH, BEFORE = 96, 4, 5
SAVES = ((0, BEFORE), (0, SIZE // (2 * BATCH)), (2, BEFORE))
#: Each save of ``SAVES`` by name, with the first epoch a resume from it delivers samples of.
RESUMES = {f"e0b{BEFORE}": 0, f"e0b{SIZE // (2 * BATCH)}": 1, f"e2b{BEFORE}": 2}


def run_jobs(run_epochs: Callable[..., Any], jobs: dict[str, tuple]) -> dict[str, Any]:
    """On each rank: ``run_epochs(*job)`` for every named job, in order."""
    return {name: run_epochs(*job) for name, job in jobs.items()}


def chained_runs(run_epochs: Callable[..., Any]) -> Any:
    """A module fixture: every run's per-rank results by name (``"uninterrupted"``, ``"2 -> 2 from
    e0b12"``, ``"2 -> 3 in epoch 2"``, ``"saved on 4"``, ``"4 -> 3"``...)."""

    @pytest.fixture(scope="module")
    def runs(tmp_path_factory: Any) -> dict[str, list]:
        root = str(tmp_path_factory.mktemp("runs"))
        results: dict[str, list] = {}

        def run(world: int, jobs: dict[str, tuple]) -> None:
            per_rank = spawned_ranks.run(world, run_jobs, run_epochs, jobs)
            results.update({name: [rank[name] for rank in per_rank] for name in jobs})

        def resume(saved: str, epoch: int, epochs: int) -> tuple:
            return (f"{root}/again", epochs, (), f"{root}/{saved}", epoch)

        run(2, {"uninterrupted": (f"{root}/2", 3, SAVES)})
        run(4, {"2 -> 4": resume(f"2/e0b{BEFORE}", 0, 2), "saved on 4": (f"{root}/4", 1, ((0, BEFORE),))})
        run(3, {"2 -> 3": resume(f"2/e0b{BEFORE}", 0, 2), "2 -> 3 in epoch 2": resume(f"2/e2b{BEFORE}", 2, 4),
                "4 -> 3": resume(f"4/e0b{BEFORE}", 0, 1), "saved on 3": (f"{root}/3", 1, ((0, BEFORE),))})
        run(2, {**{f"2 -> 2 from {name}": resume(f"2/{name}", epoch, 3) for name, epoch in RESUMES.items()},
                "3 -> 2": resume(f"3/e0b{BEFORE}", 0, 1)})
        run(1, {"2 -> 1": resume(f"2/e0b{BEFORE}", 0, 2)})
        return results

    return runs


def before(ranks: list, loader: str, epoch: int) -> list[int]:
    """Every rank's samples of ``epoch`` before a save after ``BEFORE`` batches."""
    return [i for rank in ranks for i in rank[loader][epoch][:BEFORE * BATCH]]


def assert_every_sample_once(ranks: list, loaders, epochs) -> None:
    for loader in loaders:
        for epoch in epochs:
            assert sorted(i for rank in ranks for i in rank[loader][epoch]) == list(range(SIZE)), (loader, epoch)


def assert_continues(runs: dict[str, list], loaders) -> None:
    """Every save of ``RESUMES`` resumed on the 2 ranks that saved it delivers, on each rank, the
    uninterrupted run's rest of that epoch and its later epochs."""
    saved = runs["uninterrupted"]
    assert_every_sample_once(saved, loaders, range(3))
    for name, first in RESUMES.items():
        skip = BEFORE * BATCH if name.endswith(f"b{BEFORE}") else 0
        for loader in loaders:
            for rank, (mine, again) in enumerate(zip(saved, runs[f"2 -> 2 from {name}"])):
                expected = {first: mine[loader][first][skip:], **{e: mine[loader][e] for e in range(first + 1, 3)}}
                assert again[loader] == expected, (name, loader, rank)


def assert_rest_once(runs: dict[str, list], saved: str, resumed: str, loaders, epoch: int = 0) -> None:
    """The samples before a save after ``BEFORE`` batches of ``epoch`` and those a resume delivers are
    every sample once; where the resume ran on, the next epoch is a permutation of the dataset."""
    for loader in loaders:
        after = [i for rank in runs[resumed] for i in rank[loader][epoch]]
        assert sorted(before(runs[saved], loader, epoch) + after) == list(range(SIZE)), (loader, epoch)
    if epoch + 1 in runs[resumed][0][next(iter(loaders))]:
        assert_every_sample_once(runs[resumed], loaders, [epoch + 1])
