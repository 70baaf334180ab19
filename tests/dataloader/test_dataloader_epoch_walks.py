"""The arithmetic of a resumed epoch, on every small case: what the saved ranks consumed is found as a
prefix of the epoch's order, and the rest is dealt to any number of new ranks so that every position
not yet consumed is delivered exactly once; where the shares would differ by a batch, the short ranks
repeat positions consumed before the save (or, with ``drop``, the long ones stop early) so that every
rank takes the same number of batches, each share a run of whole batches but its last."""

from __future__ import annotations

import itertools

import pytest

import bcp
from bcp.adapters.epoch_walks import Walk, batch_count, class_size, consumed_prefix, resumed_walk


def _records(world: int, done: list[int], length: int) -> list[dict]:
    return [Walk(world, r, 0, class_size(length, world, r)).record(d) for r, d in enumerate(done)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_lockstep_ranks_consumed_a_prefix_of_the_order(world):
    for length, steps in itertools.product(range(1, 30), range(0, 10)):
        done = [min(steps, class_size(length, world, r)) for r in range(world)]
        consumed = {r + k * world for r in range(world) for k in range(done[r])}
        assert consumed_prefix(_records(world, done, length), length) == len(consumed)
        assert consumed == set(range(len(consumed)))


def test_ranks_out_of_step_are_refused():
    assert consumed_prefix(_records(2, [5, 4], 96), 96) == 9  # rank 0 one ahead: still positions 0..8
    with pytest.raises(bcp.MismatchError, match=r"had consumed \[4, 5\] of their shares"):
        consumed_prefix(_records(2, [4, 5], 96), 96)  # rank 1 ahead: position 8 not consumed, 9 was
    with pytest.raises(bcp.MismatchError, match=r"consumed \[4, 5, 5\]"):
        consumed_prefix(_records(3, [4, 5, 5], 96), 96)  # rank 0 behind: position 12 not consumed, 13 was


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("batch_drop_last", [False, True])
def test_the_rest_of_an_epoch_is_dealt_once_to_any_number_of_ranks_in_equal_numbers_ofbatch_count(drop, batch_drop_last):
    for length, world, batch_size in itertools.product(range(1, 26), range(1, 6), range(1, 5)):
        for prefix in range(0, length):
            walks = [resumed_walk(prefix, length, world, r, batch_size, drop=drop or batch_drop_last,
                                  batch_drop_last=batch_drop_last) for r in range(world)]
            delivered = [p for walk in walks
                         for p in list(walk.positions())[:batch_count(walk.count(), batch_size, batch_drop_last)
                                                          * batch_size if batch_drop_last else None]]
            fresh = [p for p in delivered if p < length]
            assert len(fresh) == len(set(fresh)) and set(fresh) <= set(range(prefix, length))
            counts = {batch_count(walk.count(), batch_size, batch_drop_last) for walk in walks}
            assert len(counts) == 1, (length, world, batch_size, prefix)
            if not (drop or batch_drop_last):  # repeating: every remaining position is delivered
                assert set(fresh) == set(range(prefix, length))
                repeated = [p for p in delivered if p >= length]
                assert len(repeated) < 2 * world  # a couple at most per short rank, from the order's start
            elif not batch_drop_last:  # dropping: what is not delivered is the order's last positions
                missing = set(range(prefix, length)) - set(fresh)
                assert all(p >= length - 2 * world for p in missing)


def test_a_share_of_batches_of_positions_cuts_the_order_intobatch_count():
    walk = Walk(3, 1, 0, 3, unit=4)  # accelerate's dealing: batches 1, 4 and 7 of the order
    assert walk.indices(list(range(100, 130)), 30) == list(range(104, 108)) + list(range(116, 120)) + [128, 129]
