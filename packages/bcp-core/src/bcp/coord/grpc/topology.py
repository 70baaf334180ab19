"""The tree an exchange travels (paper section 5.2): the ranks of one machine under their local
leader (the machine's lowest rank), and the machines' leaders in a tree of ``fan_out`` children
each, machine 0's leader at the root. Every node so talks to at most ``ranks_per_machine - 1 +
fan_out`` children and one parent, whatever the world size, and the tree is
``1 + ceil(log_fan_out(machines))`` levels deep."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tree:
    """``parents[r]`` is rank r's parent (-1 at the root, rank 0)."""

    parents: tuple[int, ...]

    @staticmethod
    def build(world_size: int, ranks_per_machine: int, fan_out: int) -> "Tree":
        """Machines are runs of ``ranks_per_machine`` consecutive ranks, as launchers number them."""
        if world_size < 1 or ranks_per_machine < 1 or fan_out < 1:
            raise ValueError(f"a tree needs positive sizes, got world_size={world_size}, "
                             f"ranks_per_machine={ranks_per_machine}, fan_out={fan_out}")
        parents = [r - r % ranks_per_machine for r in range(world_size)]
        leaders = range(0, world_size, ranks_per_machine)
        for i, leader in enumerate(leaders):
            parents[leader] = leaders[(i - 1) // fan_out] if i else -1
        return Tree(tuple(parents))

    @property
    def world_size(self) -> int:
        return len(self.parents)

    def children(self, rank: int) -> list[int]:
        return list(self._children_of(rank))

    def subtree(self, rank: int) -> list[int]:
        """``rank`` and every rank below it, in ascending order."""
        found, todo = [], [rank]
        while todo:
            node = todo.pop()
            found.append(node)
            todo.extend(self._children_of(node))
        return sorted(found)

    def depth(self, rank: int) -> int:
        """Edges between ``rank`` and the root."""
        edges = 0
        while self.parents[rank] >= 0:
            rank, edges = self.parents[rank], edges + 1
        return edges

    def height(self, rank: int) -> int:
        """Edges on the longest way from ``rank`` down to a leaf (0 at a leaf)."""
        below = self._children_of(rank)
        return 1 + max(self.height(c) for c in below) if below else 0

    def _children_of(self, rank: int) -> tuple[int, ...]:
        return self._children_table()[rank]

    def _children_table(self) -> tuple[tuple[int, ...], ...]:
        table = self.__dict__.get("_table")
        if table is None:  # built once, on first use: a frozen dataclass caches through __dict__
            lists: list[list[int]] = [[] for _ in self.parents]
            for rank, parent in enumerate(self.parents):
                if parent >= 0:
                    lists[parent].append(rank)
            table = tuple(tuple(c) for c in lists)
            object.__setattr__(self, "_table", table)
        return table
