"""The name of one sharded part of a dataloader's state: which data-parallel rank of how many, which
read worker of how many. Its own module, so the loaders' adapters can name parts without importing
the dataloader component that assembles them."""

from __future__ import annotations

import re
from dataclasses import dataclass

_PART_NAME = re.compile(r"shard/dp(\d+)-of-(\d+)/worker(\d+)-of-(\d+)")


@dataclass(frozen=True, slots=True, order=True)
class PartKey:
    """Which sharded part: DP index ``dp`` of ``dp_size``, read worker ``worker`` of ``workers``."""

    dp: int
    dp_size: int
    worker: int
    workers: int

    @property
    def name(self) -> str:
        """The part's value name under ``dataloader/``."""
        return f"shard/dp{self.dp}-of-{self.dp_size}/worker{self.worker}-of-{self.workers}"

    @staticmethod
    def parse(name: str) -> "PartKey | None":
        found = _PART_NAME.fullmatch(name)
        return PartKey(*map(int, found.groups())) if found else None
