"""The one coverage check (``bcp.layout.coverage``): exact against brute force, and used where it
matters: the save planner refuses pieces whose overlap hides a gap, and a load refuses a shard table
whose shards do not cover a tensor exactly.

Guards a past defect: load checked only the covered volume, so a damaged shard table with two rows
over the same half of a tensor (the other half never stored) loaded "successfully" and left half of
the live tensor with its old values."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch

import bcp
from bcp.layout.box import flat_range_to_boxes
from bcp.layout.coverage import GAP, OVERLAP, first_cover_problem


def _exactly_once(shape, boxes) -> bool:
    counts = np.zeros(shape, dtype=int)
    for offsets, lengths in boxes:
        counts[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] += 1
    return bool((counts == 1).all())


def _random_layout(rng: random.Random) -> tuple[tuple[int, ...], list]:
    shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
    boxes = []
    if rng.random() < 0.4:  # flat shards cut into boxes
        n = int(np.prod(shape))
        cuts = [0, *sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 4)))), n] if n > 1 else [0, n]
        for low, high in zip(cuts, cuts[1:]):
            boxes += [(b.offsets, b.lengths) for b, _ in flat_range_to_boxes(shape, low, high - low)]
    else:  # a grid (tensor parallel on several dims)
        splits = [sorted({0, d, *rng.sample(range(d + 1), rng.randint(0, 2))}) for d in shape]
        for cell in itertools.product(*[list(zip(s, s[1:])) for s in splits]):
            boxes.append((tuple(a for a, _ in cell), tuple(b - a for a, b in cell)))
    mutation = rng.random()
    if mutation < 0.3 and boxes:
        boxes.pop(rng.randrange(len(boxes)))
    elif mutation < 0.5 and boxes:
        boxes.append(boxes[rng.randrange(len(boxes))])
    elif mutation < 0.6 and boxes:
        i, d = rng.randrange(len(boxes)), rng.randrange(len(shape))
        offsets, lengths = boxes[i]
        if lengths[d] > 1:
            boxes[i] = (offsets, lengths[:d] + (lengths[d] - 1,) + lengths[d + 1:])
    return shape, boxes


def test_exact_coverage_agrees_with_counting_every_element():
    rng = random.Random(0)
    for _ in range(3000):
        shape, boxes = _random_layout(rng)
        ncols = 3
        offsets = np.array([[0] * ncols] + [list(o) + [0] * (ncols - len(shape)) for o, _ in boxes], dtype=np.int64)
        lengths = np.array([[4] + [1] * (ncols - 1)] + [list(n) + [1] * (ncols - len(shape)) for _, n in boxes],
                           dtype=np.int64)
        tensor = np.array([0] + [1] * len(boxes), dtype=np.int64)  # tensor 0, (4,), is covered
        problem = first_cover_problem([(4,), shape], tensor, offsets, lengths)
        assert (problem is None) == _exactly_once(shape, boxes), (shape, boxes, problem)
        if problem is not None:
            assert problem.tensor == 1


def test_an_overlap_hiding_a_gap_is_named():
    # [0, 256) twice and [256, 512) never: the volume is right, the coverage is not
    problem = first_cover_problem([(512,)], np.zeros(2, dtype=np.int64), np.array([[0], [0]]), np.array([[256], [256]]))
    assert problem is not None and problem.kind in (GAP, OVERLAP)
    assert "held by" in problem.describe()


def test_the_planner_refuses_many_pieces_whose_overlap_hides_a_gap(tmp_path):
    # 100 pieces (beyond the old pairwise limit of 64): one row is held twice, another by nobody
    pieces = [bcp.TensorShard(torch.ones(1, 4), (100, 4), (i if i != 50 else 49, 0)) for i in range(100)]
    with pytest.raises(bcp.MismatchError, match="do not cover the tensor"):
        bcp.save(tmp_path, {"model": {"w": pieces}})


def test_a_load_refuses_a_shard_table_that_covers_half_a_tensor_twice(tmp_path):
    bcp.save(tmp_path, {"model": {"w": [bcp.TensorShard(torch.arange(256.0), (512,), (0,)),
                                        bcp.TensorShard(torch.arange(256.0, 512.0), (512,), (256,))]}})
    table = next(tmp_path.glob("gen-*/shard_table.bin"))
    data = bytearray(table.read_bytes())
    # the table's first columns are the boxes' offsets (int64 per row): move the second shard to 0
    offsets = np.frombuffer(data, dtype=np.int64, count=2).tolist()
    assert sorted(offsets) == [0, 256]
    row = offsets.index(256)
    data[8 * row: 8 * row + 8] = np.int64(0).tobytes()
    table.write_bytes(bytes(data))
    _rewrite_table_checksum(table)
    live = torch.full((512,), -1.0)
    with pytest.raises(bcp.CorruptCheckpointError, match="do not cover the tensor exactly") as caught:
        bcp.load(tmp_path, {"model": {"w": live}})
    assert "model/w" in str(caught.value)


def _rewrite_table_checksum(table) -> None:
    """Keep the damaged table consistent with its manifest (as a buggy writer would leave it), so the
    load gets past the table checksum to the coverage check."""
    from bcp.engine.checksum import crc_of

    manifest_path = table.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["shard_table"]["crc32c"] = crc_of(memoryview(table.read_bytes()))
    manifest_path.write_text(json.dumps(manifest))
    marker_path = table.parent / "COMMITTED"
    marker = json.loads(marker_path.read_text())
    data = manifest_path.read_bytes()
    marker.update(manifest_bytes=len(data), manifest_crc32c=crc_of(memoryview(data)))
    marker_path.write_text(json.dumps(marker))
