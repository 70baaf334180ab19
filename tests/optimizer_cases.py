"""Every optimizer of ``torch.optim`` with each of its options, and the comparison of two optimizer
state dicts entry for entry: what the optimizer-semantics tests of bcp.load, Lightning and
Accelerate share.

The cases are found, not listed: every ``torch.optim.Optimizer`` subclass that ``torch.optim``
exports, with its defaults and with each boolean option turned from its default (``amsgrad``,
``foreach``, ``fused``, ``capturable``, ``centered``, ``nesterov``, ...) and ``momentum`` where it
defaults to 0 (it adds a momentum buffer), Nesterov's with it. ``differentiable`` is left out: it makes the step itself
differentiable and changes no state. Cases torch itself cannot run here (``capturable`` on the CPU)
are reported by :func:`torch_runs` with torch's own message.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from models import batch, world

#: Options that change nothing in the state and are not about checkpoints.
_NOT_STATE = {"differentiable"}
#: What an option needs beside it where the default does not give it (SGD's Nesterov needs momentum).
_WITH = {"nesterov": {"momentum": 0.9}}
STEPS = 3
#: Optimizers whose never-stepped state differs in kind: none (Adam, SGD), made when built
#: (Adagrad), made by a step that needs a closure (L-BFGS) or sparse gradients (SparseAdam).
NEVER_STEPPED = ["Adam", "SGD", "SGD-momentum=0.9", "Adagrad", "LBFGS", "SparseAdam"]


@dataclass(frozen=True)
class OptimizerCase:
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.name + "".join(f"-{k}={v}" for k, v in self.options.items())

    def make(self, params: Any) -> torch.optim.Optimizer:
        return getattr(torch.optim, self.name)(params, **self.options)


def optimizer_classes() -> list[str]:
    return sorted(name for name, cls in vars(torch.optim).items()
                  if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer)


def optimizer_cases() -> list[OptimizerCase]:
    cases = []
    for name in optimizer_classes():
        cases.append(OptimizerCase(name))
        for option, parameter in inspect.signature(getattr(torch.optim, name).__init__).parameters.items():
            if option in _NOT_STATE:
                continue
            if "bool" in str(parameter.annotation):
                turned = not parameter.default
                cases.append(OptimizerCase(name, {option: turned, **(_WITH.get(option, {}) if turned else {})}))
            elif option == "momentum" and parameter.default == 0:
                cases.append(OptimizerCase(name, {option: 0.9}))
    return cases


def case_by_id(case_id: str) -> OptimizerCase:
    return next(case for case in optimizer_cases() if case.id == case_id)


class DenseNet(nn.Module):
    """1-D and 2-D parameters (Adafactor keeps different state for each)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 10)
        self.norm = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class MatrixNet(nn.Module):
    """2-D parameters only: Muon takes nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 10, bias=False)
        self.fc2 = nn.Linear(10, 7, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class SparseNet(nn.Module):
    """An embedding with sparse gradients: SparseAdam takes nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 7, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb((x[:, :3].abs() * 10).long() % 30).sum(1)


def model_for(case: OptimizerCase) -> nn.Module:
    return {"Muon": MatrixNet, "SparseAdam": SparseNet}.get(case.name, DenseNet)()


def build(case: OptimizerCase, layout: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The case's model in ``layout`` (``plain``, ``ddp`` or ``fsdp2``) and its optimizer."""
    torch.manual_seed(seed)
    model = model_for(case)
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for child in model.children():
            fully_shard(child)
        fully_shard(model)
    elif layout != "plain":
        raise ValueError(layout)
    return model, case.make(model.parameters())


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    """Steps on this rank's share of the shared batches, with the closure L-BFGS needs."""
    for step in steps:
        x, y = batch(step, data_parallel=world() > 1)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)


def torch_runs(case: OptimizerCase, layout: str) -> str | None:
    """None where torch trains the case in ``layout`` here; else torch's own error (the same on
    every rank, so ranks skip together)."""
    return refusal(lambda: train(*build(case, layout, seed=0), range(1)))


def refusal(run: Callable[[], Any]) -> str | None:
    """None where ``run`` runs; else its error in one line: torch's refusal, the reason a case is skipped."""
    try:
        run()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return None


def saved_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's own checkpoint of the optimizer: a deep copy of ``state_dict()``."""
    return copy.deepcopy(optimizer.state_dict())


def loaded_by_torch(case: OptimizerCase, model: nn.Module, saved: dict[str, Any]) -> torch.optim.Optimizer:
    """A second optimizer over ``model``'s parameters, given ``saved`` by ``load_state_dict``: what
    torch's own engine gives, to compare with."""
    twin = case.make(model.parameters())
    twin.load_state_dict(copy.deepcopy(saved))
    return twin


def differences(expected: Any, actual: Any, where: str = "state_dict") -> list[str]:
    """How ``actual`` differs from ``expected``, entry for entry: keys, types, ``None``, plain
    values, tensors (dtype, shape, device, DTensor placements, every byte)."""
    if type(expected) is not type(actual):
        return [f"{where}: {type(actual).__name__} where torch gives {type(expected).__name__}"]
    if isinstance(expected, dict):
        if set(expected) != set(actual):
            return [f"{where}: keys {sorted(actual, key=str)} where torch gives {sorted(expected, key=str)}"]
        return [d for key in expected for d in differences(expected[key], actual[key], f"{where}[{key!r}]")]
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            return [f"{where}: {len(actual)} items where torch gives {len(expected)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]")]
    if isinstance(expected, torch.Tensor):
        return _tensor_differences(expected, actual, where)
    same = expected == actual or (expected != expected and actual != actual)  # NaN hyper-parameters
    return [] if same else [f"{where}: {actual!r} where torch gives {expected!r}"]


def _tensor_differences(expected: torch.Tensor, actual: torch.Tensor, where: str) -> list[str]:
    if hasattr(expected, "placements"):
        if expected.placements != actual.placements or expected.shape != actual.shape:
            return [f"{where}: DTensor {actual.placements} {list(actual.shape)} where torch gives "
                    f"{expected.placements} {list(expected.shape)}"]
        expected, actual = expected.to_local(), actual.to_local()
    meta = (expected.dtype, expected.shape, expected.device, expected.layout)
    if (actual.dtype, actual.shape, actual.device, actual.layout) != meta:
        return [f"{where}: {actual.dtype} {list(actual.shape)} on {actual.device} ({actual.layout}) where torch "
                f"gives {expected.dtype} {list(expected.shape)} on {expected.device} ({expected.layout})"]
    if expected.is_sparse:
        expected, actual = expected.to_dense(), actual.to_dense()
    if not torch.equal(_bytes(expected), _bytes(actual)):
        return [f"{where}: values differ"]
    return []


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def compare_cases(layout: str, load: Callable[[OptimizerCase, nn.Module, torch.optim.Optimizer, str], None],
                  save: Callable[[OptimizerCase, nn.Module, torch.optim.Optimizer, str], None],
                  workdir: str, steps: int = STEPS, case_ids: list[str] | None = None) -> dict[str, list[str]]:
    """For every case (of ``case_ids``) torch runs in ``layout``: train ``steps``, ``save`` (bcp)
    and take torch's state dict; load each into a fresh model and optimizer; the differences of
    the bcp-loaded optimizer's ``state_dict()`` from the torch-loaded one's (``skipped: ...`` where
    torch cannot run the case)."""
    found: dict[str, list[str]] = {}
    for number, case in enumerate(optimizer_cases()):
        if case_ids is not None and case.id not in case_ids:
            continue
        refused = torch_runs(case, layout)
        if refused is not None:
            found[case.id] = [f"skipped: {refused}"]
            continue
        model, optimizer = build(case, layout, seed=1)
        train(model, optimizer, range(steps))
        path = f"{workdir}/{number}"
        save(case, model, optimizer, path)
        torch_saved = saved_state(optimizer)
        fresh, by_bcp = build(case, layout, seed=2)
        load(case, fresh, by_bcp, path)
        found[case.id] = differences(loaded_by_torch(case, fresh, torch_saved).state_dict(), by_bcp.state_dict())
    return found


def failures(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {case: diffs for case, diffs in found.items() if diffs and not diffs[0].startswith("skipped")}
