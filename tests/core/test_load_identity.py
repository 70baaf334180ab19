"""What a load keeps of the objects training holds: a transactional load places staged bytes by
exchanging memory under the live storage where that memory is torch's own and no one else's, and
copies into it elsewhere. Either way every tensor object, Parameter, storage object and view the
caller holds stays the one it was (an optimizer's references stay valid), the values are the saved
ones bit for bit, and a failed load changes neither values nor memory."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from torch import nn

import bcp
from bcp.api.checkpoint import open_checkpoint
from bcp.engine import read_segments

WIDTH = 32


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(WIDTH, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.embed(tokens))))


def _trained(seed: int, steps: int) -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        _step(model, optimizer)
    return model, optimizer


def _step(model: Tied, optimizer: torch.optim.Optimizer) -> None:
    tokens = torch.arange(WIDTH) % 7
    optimizer.zero_grad()
    model(tokens).square().mean().backward()
    optimizer.step()


def _held(model: Tied, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """What training holds: the Parameter objects, the optimizer's references to them, a view."""
    return {"params": dict(model.named_parameters()), "groups": [list(g["params"]) for g in optimizer.param_groups],
            "row": model.hidden.weight[3]}


def _flip_a_byte(path) -> None:
    data = max(path.glob("gen-*/data/*.bin"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_a_load_keeps_the_parameters_the_optimizer_holds_and_training_goes_on_as_saved(tmp_path):
    """After a load into a differently trained model and AdamW: the same Parameter objects (the
    optimizer's param groups still hold them, the tied weight is still one Parameter), a view taken
    before the load sees the loaded values, and the next step equals the saved run's next step."""
    saved_model, saved_optimizer = _trained(seed=0, steps=3)
    bcp.save(tmp_path, {"model": saved_model, "optim": saved_optimizer})
    model, optimizer = _trained(seed=1, steps=5)
    held = _held(model, optimizer)
    exchanged = {name: p.data_ptr() for name, p in model.named_parameters()}
    bcp.load(tmp_path, {"model": model, "optim": optimizer})
    assert dict(model.named_parameters()) == held["params"]  # the same objects, by identity
    assert all(a is b for group, was in zip(optimizer.param_groups, held["groups"]) for a, b in zip(group["params"], was))
    assert model.out.weight is model.embed.weight
    assert torch.equal(held["row"], saved_model.hidden.weight[3])
    assert any(p.data_ptr() != exchanged[name] for name, p in model.named_parameters())  # placed by exchange
    _step(model, optimizer)
    _step(saved_model, saved_optimizer)
    for (name, p), q in zip(model.named_parameters(), saved_model.parameters()):
        assert torch.equal(p, q), name


def test_a_failed_load_changes_no_value_no_memory_and_no_object(tmp_path):
    saved_model, saved_optimizer = _trained(seed=0, steps=3)
    bcp.save(tmp_path, {"model": saved_model, "optim": saved_optimizer})
    _flip_a_byte(tmp_path)
    model, optimizer = _trained(seed=1, steps=5)
    held = _held(model, optimizer)
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    with pytest.raises(bcp.CorruptCheckpointError, match="checksum mismatch"):
        bcp.load(tmp_path, {"model": model, "optim": optimizer})
    assert dict(model.named_parameters()) == held["params"] and model.out.weight is model.embed.weight
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name][0] and torch.equal(p, before[name][1]), name
    for p, state in optimizer.state.items():
        assert all(torch.equal(v, moments[id(p)][k]) for k, v in state.items())


def test_loads_after_loads_never_write_into_memory_a_live_tensor_holds(tmp_path):
    """After an exchange the staging pool holds the live tensors' previous memory: loads of two
    checkpoints in turn, then a failed one, leave the live tensors exactly as the last good load."""
    first, second = {"w": torch.arange(1 << 16, dtype=torch.float32)}, {"w": -torch.arange(1 << 16, dtype=torch.float32)}
    bcp.save(tmp_path / "first", first)
    bcp.save(tmp_path / "second", second)
    bcp.save(tmp_path / "damaged", first)
    _flip_a_byte(tmp_path / "damaged")
    live = {"w": torch.zeros(1 << 16)}
    view = live["w"][100:200]
    for path, expected in ((tmp_path / "first", first), (tmp_path / "second", second), (tmp_path / "first", first)):
        bcp.load(path, live)
        assert torch.equal(live["w"], expected["w"]) and torch.equal(view, expected["w"][100:200])
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(tmp_path / "damaged", live)
    assert torch.equal(live["w"], first["w"])


def _live(kind: str, tmp_path) -> tuple[torch.Tensor, object]:
    """A zeroed live tensor of ``kind``, and what else sees its memory (kept alive by the caller)."""
    tensor = torch.zeros(1 << 14)
    if kind == "shared memory":
        return tensor.share_memory_(), None
    if kind == "numpy view":
        return tensor, tensor.numpy()  # while it lives, torch marks the storage as not resizable
    if kind == "torch.load":
        torch.save(tensor, tmp_path / "t.pt")
        return torch.load(tmp_path / "t.pt", weights_only=True), None
    if kind == "safetensors":
        safetensors.torch.save_file({"t": tensor}, tmp_path / "t.safetensors")
        return safetensors.torch.load_file(tmp_path / "t.safetensors")["t"], None
    return tensor, None


@pytest.mark.parametrize("kind", ["own", "shared memory", "numpy view", "torch.load", "safetensors"])
def test_memory_that_others_may_see_is_copied_into_and_the_rest_exchanged(tmp_path, kind):
    """Memory only torch's allocator holds is exchanged (the tensor's address changes); memory
    shared with other processes, viewed by numpy or made outside the allocator (torch.load's, safetensors') is
    copied into, so whoever else sees it sees the loaded values."""
    saved = torch.arange(1 << 14, dtype=torch.float32)
    bcp.save(tmp_path / "ckpt", {"w": saved})
    live, array = _live(kind, tmp_path)
    address = live.data_ptr()
    bcp.load(tmp_path / "ckpt", {"w": live})
    assert torch.equal(live, saved)
    assert (live.data_ptr() != address) == (kind == "own")
    if array is not None:
        assert array.tolist() == saved.tolist()  # the numpy array sees the loaded values


def test_a_reader_checking_one_batch_while_reading_the_next_places_every_byte(monkeypatch):
    """One reader thread, a column slice through scratch memory in several batches (from a storage
    that hands out no buffers of its own): each batch is verified and copied out of its scratch
    buffer while the next is read into the other one; bitwise."""
    monkeypatch.setattr(read_segments, "READ_PART_BYTES", 8 << 20)  # a few batches of a 16 MiB tensor
    saved = torch.randn(4096, 1024)
    bcp.save("memory://identity/batches", {"t": saved})
    checkpoint = open_checkpoint("memory://identity/batches", io_threads=1)
    assert torch.equal(checkpoint.read("t", (slice(None), slice(5, 700))), saved[:, 5:700])


def test_a_damaged_batch_found_while_the_next_is_read_fails_the_load_and_places_nothing(tmp_path):
    """One reader thread over four files: the flipped byte lies in the first file's batch, checked
    while the reader goes on to the next file; the load fails and no live tensor moves."""
    saved = {f"w{i}": torch.full((1 << 16,), float(i)) for i in range(4)}
    bcp.save(tmp_path, saved, io_threads=4)
    first = min(tmp_path.glob("gen-*/data/*.bin"))
    raw = bytearray(first.read_bytes())
    raw[100] ^= 0xFF
    first.write_bytes(bytes(raw))
    live = {name: torch.full((1 << 16,), -1.0) for name in saved}
    with pytest.raises(bcp.CorruptCheckpointError, match="checksum mismatch"):
        bcp.load(tmp_path, live, io_threads=1)
    assert all(torch.all(tensor == -1) for tensor in live.values())
