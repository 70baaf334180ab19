"""The gRPC coordinator's tree: machines under their local leader, leaders under leaders by fan-out."""

from __future__ import annotations

import pytest

from bcp.coord.grpc import Tree


def test_ranks_of_a_machine_hang_under_its_lowest_rank():
    tree = Tree.build(16, ranks_per_machine=8, fan_out=4)
    assert tree.children(0) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert tree.children(8) == list(range(9, 16))
    assert tree.parents[0] == -1 and tree.depth(15) == 2


@pytest.mark.parametrize("world,per_machine,fan_out", [(64, 8, 2), (8960, 8, 8), (100, 1, 3), (7, 2, 2), (1, 8, 8)])
def test_every_rank_is_in_one_tree_of_bounded_fan_in_and_logarithmic_depth(world, per_machine, fan_out):
    tree = Tree.build(world, per_machine, fan_out)
    assert tree.subtree(0) == list(range(world))
    assert max(tree.depth(r) for r in range(world)) == expected_depth(world, per_machine, fan_out)
    for rank in range(world):
        leaders_below = [c for c in tree.children(rank) if c % per_machine == 0]
        local_below = [c for c in tree.children(rank) if c % per_machine != 0]
        assert len(leaders_below) <= fan_out
        assert len(local_below) == (min(world, rank + per_machine) - rank - 1 if rank % per_machine == 0 else 0)


def expected_depth(world: int, per_machine: int, fan_out: int) -> int:
    """Machine leaders fill a fan_out-ary tree level by level (machine m at the level where the
    first m + 1 places run out); a machine's other ranks sit one level below its leader."""
    def level(machine: int) -> int:
        depth, held = 0, 1
        while held <= machine:
            depth += 1
            held += fan_out ** depth
        return depth

    sizes = [min(per_machine, world - start) for start in range(0, world, per_machine)]
    return max(level(m) + (1 if size > 1 else 0) for m, size in enumerate(sizes))


def test_a_tree_needs_positive_sizes():
    with pytest.raises(ValueError, match="positive"):
        Tree.build(8, ranks_per_machine=0, fan_out=2)
