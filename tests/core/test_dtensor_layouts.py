"""DTensor state on 1-D and 2-D meshes, any Shard(d)/Replicate placements, uneven sizes (some
ranks hold empty shards), saved in one layout and loaded into another, compared bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import bcp
from models import shard_files

SHAPES = {"w": (5, 7), "v": (3,), "s": (), "cube": (2, 3, 9), "e": (0, 4)}
DTYPES = {"w": torch.float32, "v": torch.bfloat16, "s": torch.int64, "cube": torch.float16, "e": torch.float32}


def reference(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return (torch.randn(SHAPES[name], generator=g) * 100).to(DTYPES[name])


def placements(spec: str, ndim: int):
    """'S0' Shard(0), 'R' Replicate, per mesh dim, e.g. 'S1,R'; a shard dim beyond the tensor's
    rank falls back to Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for part in spec.split(","):
        dim = int(part[1:]) if part.startswith("S") else None
        out.append(Shard(dim) if dim is not None and dim < ndim else Replicate())
    return out


def make_state(mesh_shape: tuple[int, ...], spec: str, fill: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    state = {}
    for name in SHAPES:
        full = reference(name) if fill else torch.zeros(SHAPES[name], dtype=DTYPES[name])
        state[name] = distribute_tensor(full, mesh, placements(spec, len(SHAPES[name])))
    return state


def save_case(path: str, mesh_shape: tuple[int, ...], spec: str) -> None:
    bcp.save(path, {"model": make_state(mesh_shape, spec, fill=True)})


def load_case(path: str, mesh_shape: tuple[int, ...], spec: str) -> list[str]:
    state = make_state(mesh_shape, spec, fill=False)
    bcp.load(path, {"model": state})
    return [name for name, t in state.items() if not torch.equal(t.full_tensor(), reference(name))]


CASES = [
    # (save world, mesh, placements) -> (load world, mesh, placements)
    (2, (2,), "S0", 3, (3,), "S1"),
    (3, (3,), "S1", 2, (2,), "R"),
    (2, (2,), "R", 4, (2, 2), "S0,S1"),
    (4, (2, 2), "S0,S1", 4, (2, 2), "S1,S0"),
    (4, (2, 2), "R,S2", 3, (3,), "S0"),
    (4, (4,), "S0", 2, (2,), "S2"),
    (4, (2, 2), "S1,R", 1, (1,), "S0"),
]


@pytest.mark.parametrize("sw,smesh,sspec,lw,lmesh,lspec", CASES)
def test_dtensor_reshard_bitwise(ranks, tmp_path, sw, smesh, sspec, lw, lmesh, lspec):
    path = str(tmp_path / "ckpt")
    ranks(sw).run(save_case, path, smesh, sspec)
    mismatched = ranks(lw).run(load_case, path, lmesh, lspec)
    assert mismatched == [[]] * lw


def test_dtensor_into_plain_single_process(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(4).run(save_case, path, (2, 2), "S0,S1")
    plain = {name: torch.zeros(SHAPES[name], dtype=DTYPES[name]) for name in SHAPES}
    bcp.load(path, {"model": plain})
    for name, value in plain.items():
        assert torch.equal(value, reference(name)), name


def replicated_writes(path: str) -> int:
    """Each rank's number of stored shards in a save of 4 replicated tensors (dedup spreads them)."""
    state = {f"t{i}": torch.full((256,), float(i)) for i in range(4)}
    bcp.save(path, {"model": state}, verify_replicas=True)
    return sum(1 for i in range(4) for f in shard_files(path, f"model/t{i}") if f.startswith(f"data/{dist.get_rank():05d}-"))


def test_replicated_tensors_are_written_once_and_spread(ranks, tmp_path):
    counts = ranks(2).run(replicated_writes, str(tmp_path / "ckpt"))
    assert counts == [2, 2]


def diverging_replicas(path: str) -> str:
    state = {"t": torch.full((4,), float(dist.get_rank()))}
    try:
        bcp.save(path, {"model": state}, verify_replicas=True)
    except bcp.MismatchError as exc:
        return str(exc)
    return "saved"


def test_verify_replicas_catches_diverged_ranks(ranks, tmp_path):
    messages = ranks(2).run(diverging_replicas, str(tmp_path / "ckpt"))
    assert all("replicas of box" in m and "'model/t'" in m for m in messages)
