"""Assembling the manifest from every rank's plan and writes (on the coordinating rank)."""

from __future__ import annotations

import time
from typing import Any

from bcp.layout.box import Box
from bcp.layout.manifest import ByteRange, Manifest, ObjectEntry, ShardEntry, TensorEntry


def build_manifest(*, generation: int, framework: str, checksum_chunk: int, unsafe_pickle: bool,
                   writer: str, local_plans: list[list[Any]], writes: list[list[Any]],
                   object_owners: dict[str, dict[int, int]]) -> Manifest:
    """``local_plans[r]`` is rank r's local plan (``save_plan.local_plan``); ``writes[r]`` its
    ``[files, piece writes, object writes]`` (see ``RankWrites``)."""
    files: list[str] = []
    file_base: list[int] = []
    for rank_files, _, _ in writes:
        file_base.append(len(files))
        files.extend(rank_files)

    tensors: dict[str, TensorEntry] = {}
    for plan in local_plans:
        for name, dtype, shape in plan[0]:
            if name not in tensors:
                tensors[name] = TensorEntry(name, dtype, tuple(shape))
    records: dict[tuple[str, int], tuple[ByteRange, int]] = {}
    for rank, (_, piece_writes, object_writes) in enumerate(writes):
        declared, rows = local_plans[rank][0], local_plans[rank][1]
        for index, file, offset, nbytes, crcs in piece_writes:
            tensor, offsets, lengths = rows[index][:3]
            name = declared[tensor][0]
            where = ByteRange(file_base[rank] + file, offset, nbytes, tuple(crcs))
            tensors[name].shards.append(ShardEntry(Box(tuple(offsets), tuple(lengths)), where))
        for name, file, offset, nbytes, tree, crcs in object_writes:
            records[(name, rank)] = (ByteRange(file_base[rank] + file, offset, nbytes, tuple(crcs)), tree)

    objects: dict[str, ObjectEntry] = {}
    for name, owner_of in object_owners.items():
        owners = sorted(set(owner_of.values()))
        index = {owner: i for i, owner in enumerate(owners)}
        objects[name] = ObjectEntry(
            name, [records[(name, owner)] for owner in owners],
            [index[owner_of[r]] if r in owner_of else -1 for r in range(len(writes))])

    return Manifest(generation=generation, world_size=len(writes), framework=framework, files=files,
                    tensors=tensors, objects=objects, checksum_chunk=checksum_chunk,
                    unsafe_pickle=unsafe_pickle, created_unix=time.time(), writer=writer)
