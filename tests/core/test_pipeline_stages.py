"""Pipeline stages: a model cut into stages by hand, each rank holding some layers under
their global names, with AdamW (two param groups) and an LR scheduler. A strict load into the same
stages works (each rank expects only its own stage's names), the optimizer's groups are restored by
parameter name in any layout, and a resumed run continues with the same losses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import bcp
from models import rank

LAYERS = 4
WIDTH = 6


def full_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(LAYERS)})
    return model


def stage(seed: int, index: int, stages: int) -> nn.Module:
    """Stage ``index`` of ``stages``: the full model's layers of that stage, under their global names."""
    model = full_model(seed)
    per = LAYERS // stages
    kept = {str(i) for i in range(index * per, (index + 1) * per)}
    model.layers = nn.ModuleDict({k: v for k, v in model.layers.items() if k in kept})
    return model


def optimizer_of(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": weights, "lr": 1e-2, "weight_decay": 0.1},
                                   {"params": biases, "lr": 3e-2, "weight_decay": 0.0, "betas": (0.8, 0.95)}])
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for key in sorted(model.layers, key=int):
        x = torch.tanh(model.layers[key](x))
    return x


def step_pipeline(model: nn.Module, optimizer, scheduler, step: int, stages: int) -> float:
    """One training step over ``stages`` pipeline ranks (activations and their gradients travel
    between neighbouring stages); returns the loss, on every rank."""
    x = torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(100 + step))
    index = rank() % stages
    if index > 0:
        dist.recv(x, src=rank() - 1)
    x.requires_grad_(index > 0)
    out = forward(model, x)
    loss = torch.zeros(())
    if index < stages - 1:
        dist.send(out.detach(), dst=rank() + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank() + 1)
        out.backward(grad)
    else:
        loss = (out ** 2).mean()
        loss.backward()
    if index > 0:
        dist.send(x.grad, dst=rank() - 1)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    if stages > 1:
        dist.broadcast(loss, src=rank() - index + stages - 1)
    return loss.item()


def state_of(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state[p].items():
                out[f"opt/{names[id(p)]}/{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
            out[f"group/{names[id(p)]}"] = (group["lr"], group["weight_decay"], tuple(group["betas"]))
    return out


def pp2_save_then_resume(path: str) -> dict:
    model = stage(1, rank(), 2)
    optimizer, scheduler = optimizer_of(model)
    before = [step_pipeline(model, optimizer, scheduler, s, 2) for s in range(2)]
    bcp.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    saved = state_of(model, optimizer)
    after = [step_pipeline(model, optimizer, scheduler, s, 2) for s in range(2, 4)]

    fresh = stage(9, rank(), 2)
    fresh_opt, fresh_sched = optimizer_of(fresh)
    bcp.load(path, {"model": fresh, "optimizer": fresh_opt, "scheduler": fresh_sched}, strict=True)
    same = _equal(state_of(fresh, fresh_opt), saved)
    resumed = [step_pipeline(fresh, fresh_opt, fresh_sched, s, 2) for s in range(2, 4)]
    return {"before": before, "after": after, "resumed": resumed, "same": same, "saved": saved}


def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_pipeline_stages_reload_strictly_into_the_same_stages_and_resume_with_the_same_losses(ranks, tmp_path):
    out = ranks(2).run(pp2_save_then_resume, str(tmp_path))
    for result in out:
        assert result["same"]
        assert result["resumed"] == result["after"]  # bitwise: same floats, same order of operations
    # one process loads both stages: every tensor and every parameter's group, bitwise
    model = full_model(5)
    optimizer, scheduler = optimizer_of(model)
    bcp.load(str(tmp_path), {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    merged = {**out[0]["saved"], **out[1]["saved"]}
    assert _equal(state_of(model, optimizer), merged)
    assert scheduler.last_epoch == 2 and optimizer.param_groups[1]["lr"] == 3e-2 * 0.25


def pp2_to_pp2_dp2(path: str) -> dict:
    """4 ranks as PP2 x DP2: ranks 0, 2 hold stage 0; ranks 1, 3 stage 1."""
    model = stage(7, rank() % 2, 2)
    optimizer, scheduler = optimizer_of(model)
    bcp.load(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    return state_of(model, optimizer)


def test_pipeline_stages_load_into_pp2_times_dp2(ranks, tmp_path):
    saved = ranks(2).run(pp2_save_then_resume, str(tmp_path))
    loaded = ranks(4).run(pp2_to_pp2_dp2, str(tmp_path))
    for r, state in enumerate(loaded):
        assert _equal(state, saved[r % 2]["saved"])


def test_a_strict_load_names_what_no_stage_wants(tmp_path):
    model = full_model(1)
    bcp.save(str(tmp_path), {"model": model})
    with pytest.raises(bcp.MismatchError, match="wanted by no rank: model/layers.2.bias"):
        bcp.load(str(tmp_path), {"model": stage(1, 0, 2)})


def pipelining_stage(seed: int):
    """This rank's stage of ``torch.distributed.pipelining.pipeline()``'s split of the full model
    (stage modules keep the model's FQNs), with its own AdamW."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    class Full(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = full_model(seed).layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return forward(self, x)

    pipe = pipeline(Full(), mb_args=(torch.randn(5, WIDTH),), split_spec={"layers.2": SplitPoint.BEGINNING})
    module = pipe.get_stage_module(rank())
    return pipe, module, torch.optim.AdamW(module.parameters(), lr=1e-2)


def pipelining_save_train_and_reload(path: str) -> dict:
    from torch.distributed.pipelining import ScheduleGPipe

    pipe, module, optimizer = pipelining_stage(4)
    stage_ = pipe.build_stage(rank(), torch.device("cpu"))
    schedule = ScheduleGPipe(stage_, n_microbatches=1, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(5, WIDTH, generator=g), torch.randn(5, WIDTH, generator=g)
        if rank() == 0:
            schedule.step(x)
        else:
            schedule.step(target=target)
        optimizer.step()
        optimizer.zero_grad()
    bcp.save(path, {"model": module, "optimizer": optimizer})
    saved = state_of(module, optimizer)
    _, fresh, fresh_opt = pipelining_stage(8)
    bcp.load(path, {"model": fresh, "optimizer": fresh_opt}, strict=True)
    return {"saved": saved, "same": _equal(state_of(fresh, fresh_opt), saved)}


def test_torch_pipelining_stages_save_and_load_into_the_stages_and_one_process(ranks, tmp_path):
    out = ranks(2).run(pipelining_save_train_and_reload, str(tmp_path))
    assert all(result["same"] for result in out)
    model = full_model(5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bcp.load(str(tmp_path), {"model": model, "optimizer": optimizer})
    assert _equal(state_of(model, optimizer), {**out[0]["saved"], **out[1]["saved"]})
