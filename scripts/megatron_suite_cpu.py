"""pytest plugin for scripts/megatron_suite.py: Megatron-LM's ``tests/unit_tests/dist_checkpointing``
on the CPU, in one rank of a ``torchrun`` job, with the default save strategy of the backend named
by ``BCP_SUITE_BACKEND`` (``bcp`` or ``torch_dist``). Not part of bcp: stand-ins for this run only.

Loaded with ``pytest -p megatron_suite_cpu`` before Megatron-LM's conftest files. Each stand-in
says what it replaces; none touches checkpointing code. Every finished test phase is appended to
``$BCP_SUITE_RESULTS/rank<RANK>.jsonl`` at once, so a run cut off by its timeout keeps what finished.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import types

import torch
from megatron_parts import cpu_megatron_optimizer, cuda_runtime_on_cpu

BACKEND = os.environ["BCP_SUITE_BACKEND"]
RESULTS = os.environ["BCP_SUITE_RESULTS"]
RANK = int(os.environ.get("RANK", "0"))
_CUDA = "cuda"

# A test that fails on some ranks only leaves the others waiting in a collective: give up after
# this long instead of torch's default (the rest of the run then reports "not finished").
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
_ERROR_CHARS = 1500

# The suite initialises NCCL and pins a GPU per rank: gloo, and no device to pin.
_init_process_group = torch.distributed.init_process_group


def _init_gloo(backend: str | None = None, *args, **kwargs):
    kwargs.setdefault("timeout", COLLECTIVE_TIMEOUT)
    return _init_process_group("gloo" if backend in (None, "nccl") else backend, *args, **kwargs)


torch.distributed.init_process_group = _init_gloo
torch.cuda.set_device = lambda device: None
torch.cuda.device_count = lambda: 1
# The CUDA generator and streams: the project's own test stand-ins (tests/megatron/megatron_parts.py,
# on the path megatron_suite.py gives); its DistributedOptimizer ones, below, also keep
# torch.cuda.current_device, synchronize and Tensor.cuda on the CPU.
cuda_runtime_on_cpu()
# Modules the tests move to the GPU stay on the CPU.
torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def _cpu_device(device):
    # A bare int is a CUDA ordinal (the suite passes torch.cuda.current_device()); a bool is not.
    ordinal = isinstance(device, int) and not isinstance(device, bool)
    if ordinal or (isinstance(device, (str, torch.device)) and torch.device(device).type == _CUDA):
        return torch.device("cpu")
    return device


def _factory_on_cpu(make):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return make(*args, **kwargs)
    return factory


for _name in ("empty", "zeros", "ones", "rand", "randn", "randint", "arange", "full", "tensor", "empty_like",
              "zeros_like", "ones_like", "full_like", "rand_like", "randn_like"):
    setattr(torch, _name, _factory_on_cpu(getattr(torch, _name)))
_to = torch.Tensor.to
torch.Tensor.to = lambda self, *args, **kwargs: _to(self, *[_cpu_device(a) for a in args],
                                                    **{k: _cpu_device(v) for k, v in kwargs.items()})

# The suite's session fixture downloads test data (for other test folders) when /opt/data is empty;
# this machine is offline and the downloader's imports (click, requests) are not installed.
_offline = types.ModuleType("tests.test_utils.python_scripts.download_unit_tests_dataset")


def _no_download(*args, **kwargs):
    raise RuntimeError("offline: the CPU run downloads no test data")


_offline.download_and_extract_asset = _no_download
sys.modules[_offline.__name__] = _offline

# Without Transformer Engine, Megatron's is_te_min_version compares None with a version (TypeError
# in the suite's autouse fixture): no Transformer Engine is no minimum version of it.
import importlib.util

import megatron.core.utils as _megatron_utils

if importlib.util.find_spec("transformer_engine") is None:
    _megatron_utils.is_te_min_version = lambda version, check_equality=True: False

# Megatron's destroy_model_parallel only forgets its process groups: each gloo group keeps its
# threads and sockets until the process ends (hundreds per rank after a few dozen tests, slowing
# every later one on a small machine). The groups an initialize_model_parallel created are destroyed
# with it, as a device-independent cleanup would; both backends get the same.
from megatron.core import parallel_state as _parallel_state
from torch.distributed import distributed_c10d as _c10d

_initialize_model_parallel = _parallel_state.initialize_model_parallel
_destroy_model_parallel = _parallel_state.destroy_model_parallel
_megatron_groups: list = []


def _initialize_tracking_groups(*args, **kwargs):
    before = set(_c10d._world.pg_map)
    try:
        return _initialize_model_parallel(*args, **kwargs)
    finally:
        _megatron_groups.extend(g for g in _c10d._world.pg_map if g not in before)


def _destroy_with_groups(*args, **kwargs):
    _destroy_model_parallel(*args, **kwargs)
    while _megatron_groups:
        group = _megatron_groups.pop()
        if group in _c10d._world.pg_map:
            torch.distributed.destroy_process_group(group)


_parallel_state.initialize_model_parallel = _initialize_tracking_groups
_parallel_state.destroy_model_parallel = _destroy_with_groups

# Without Apex or Transformer Engine, Megatron builds torch's Adam/AdamW, which refuse the lr=None
# of the suite's mock arguments; Apex's FusedAdam, the suite's usual optimizer, takes it (the
# learning-rate scheduler sets each param group's lr): None stands for torch's default here.
def _lr_may_be_none(init):
    def construct(self, params, lr=1e-3, *args, **kwargs):
        return init(self, params, 1e-3 if lr is None else lr, *args, **kwargs)
    return construct


for _adam in (torch.optim.Adam, torch.optim.AdamW):
    _adam.__init__ = _lr_may_be_none(_adam.__init__)

# Megatron's DDP and DistributedOptimizer without Apex or Transformer Engine on the CPU (CUDA type
# names, device='cuda' bookkeeping, the MoE router's GEMM, Adam's per-parameter 'step'): the
# project's own test stand-ins, held for the whole run.
_STAND_INS = contextlib.ExitStack()  # kept: collected, it would close the stand-ins' generator
_STAND_INS.enter_context(cpu_megatron_optimizer())

# Megatron's torch-optimizer path reads a 'step' from every parameter's state (distrib_optimizer.py:641
# in 0.16.1), which torch's Adam writes only when it steps; the suite saves optimizers whose states
# Megatron's init_state_fn made without one. Never stepped is step 0.
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as _DistributedOptimizer

_optimizer_state_dict = _DistributedOptimizer.state_dict


def _state_dict_with_steps(self):
    for state in self.optimizer.state.values():
        if state:
            state.setdefault("step", torch.tensor(0.0))
    return _optimizer_state_dict(self)


_DistributedOptimizer.state_dict = _state_dict_with_steps

# Megatron-Core 0.16.1's remove_sharded_tensors uses FileSystemWriter.metadata_path, which newer
# torch (2.13 here) has as _get_metadata_path(): a torch-version stand-in, for both backends.
from torch.distributed.checkpoint import FileSystemWriter

if not hasattr(FileSystemWriter, "metadata_path"):
    FileSystemWriter.metadata_path = property(lambda self: self._get_metadata_path())

if BACKEND == "bcp":
    # The suite's conftest makes ('torch_dist', 1) the default save strategy; here that request
    # gets bcp's ('bcp', 1). A request for torch_dist's load strategy by name gets bcp's subclass of
    # it, which reads bcp checkpoints and hands torch_dist ones to torch_dist (what Megatron-LM 0.17
    # gets under bcp_megatron.launch). Strategies a test builds by class stay what they are.
    import bcp_megatron  # noqa: F401  (registers ('bcp', 1))
    from bcp_megatron.strategies_torch_dist import BcpLoadShardedStrategy
    from megatron.core.dist_checkpointing.strategies import base

    _get_default_strategy = base.get_default_strategy

    def _bcp_by_default(action, backend, version):
        if (backend, version) == ("torch_dist", 1):
            if action == base.StrategyAction.SAVE_SHARDED:
                backend = "bcp"
            elif action == base.StrategyAction.LOAD_SHARDED:
                return BcpLoadShardedStrategy()
        return _get_default_strategy(action, backend, version)

    for _module in list(sys.modules.values()):
        if getattr(_module, "get_default_strategy", None) is _get_default_strategy:
            _module.get_default_strategy = _bcp_by_default


def pytest_configure(config) -> None:
    # Ranks share checkpoints through basetemp's parent (the suite's tmp_path_dist_ckpt fixture).
    config.option.basetemp = os.path.join(RESULTS, "tmp", f"rank{RANK}")
    # torchrun starts its workers in sessions of their own: the driver ends them by pid on a timeout.
    with open(os.path.join(RESULTS, f"rank{RANK}.pid"), "w") as out:
        out.write(str(os.getpid()))


def pytest_runtest_logreport(report) -> None:
    phase = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.failed:  # the end of the traceback: the error and where it was raised
        phase["error"] = report.longreprtext[-_ERROR_CHARS:]
    with open(os.path.join(RESULTS, f"rank{RANK}.jsonl"), "a") as out:
        out.write(json.dumps(phase) + "\n")
