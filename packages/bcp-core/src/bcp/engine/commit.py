"""Assembling the manifest from every rank's plan and writes (on the coordinating rank)."""

from __future__ import annotations

import time
from typing import Any

from bcp.layout.box import Box
from bcp.layout.manifest import ByteRange, Manifest, ObjectEntry, ShardEntry, TensorEntry
from bcp.planning.save_plan import plan_pieces


def build_manifest(*, generation: int, framework: str, checksum_chunk: int, writer: str,
                   local_plans: list[list[Any]], writes: list[list[Any]]) -> Manifest:
    """``local_plans[r]`` is rank r's local plan (``save_plan.local_plan``); ``writes[r]`` what it
    wrote (``RankWrites.to_wire``)."""
    files: list[str] = []
    file_base: list[int] = []
    for rank_files, *_ in writes:
        file_base.append(len(files))
        files.extend(rank_files)

    tensors: dict[str, TensorEntry] = {}
    for plan in local_plans:
        for name, dtype, shape in plan[0]:
            if name not in tensors:
                tensors[name] = TensorEntry(name, dtype, tuple(shape))
    per_rank: dict[str, dict[int, tuple[ByteRange, int]]] = {}
    for rank, (_, piece_writes, object_writes, _) in enumerate(writes):
        declared = local_plans[rank][0]
        tensor, offsets, lengths = plan_pieces(local_plans[rank])
        for spec, file, offset, nbytes, crcs in piece_writes:
            index = spec if isinstance(spec, int) else spec[0]
            ndim = len(declared[tensor[index]][2])
            box = (Box(tuple(offsets[index, :ndim].tolist()), tuple(lengths[index, :ndim].tolist()))
                   if isinstance(spec, int) else Box(tuple(spec[1]), tuple(spec[2])))
            where = ByteRange(file_base[rank] + file, offset, nbytes, tuple(crcs))
            tensors[declared[tensor[index]][0]].shards.append(ShardEntry(box, where))
        for name, file, offset, nbytes, tree, crcs in object_writes:
            where = ByteRange(file_base[rank] + file, offset, nbytes, tuple(crcs))
            per_rank.setdefault(name, {})[rank] = (where, tree)

    objects: dict[str, ObjectEntry] = {}
    for name, by_rank in per_rank.items():
        holders = sorted(by_rank)
        index = {rank: i for i, rank in enumerate(holders)}
        objects[name] = ObjectEntry(name, [by_rank[r] for r in holders],
                                    [index.get(r, -1) for r in range(len(writes))])

    return Manifest(generation=generation, world_size=len(writes), framework=framework, files=files,
                    tensors=tensors, objects=objects, checksum_chunk=checksum_chunk,
                    unsafe_pickle=any(w[3] for w in writes), created_unix=time.time(), writer=writer)
