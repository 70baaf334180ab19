"""The private names of torch that the core reads (``bcp.torch_internals``), each read by name in the
installed torch: this test fails when a torch upgrade moves one (the dataloader's are in
``tests/dataloader/test_dataloader_torch_internals.py``). A moved name fails naming itself and the
tested versions."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from bcp.torch_internals import TESTED, MovedNameError, installed_version, private_module, private_name
from bcp.torch_internals import distributed, fsdp1, tensors


def test_the_installed_torch_is_a_tested_one():
    low, high = TESTED["torch"]
    assert low <= installed_version("torch") < high


def test_a_moved_name_fails_naming_it_and_the_tested_versions():
    tested = r"tested with torch 2\.4 to before 2\.14 \(installed: \d+\.\d+\)"
    with pytest.raises(MovedNameError, match=r"Tensor\._moved is missing: bcp reads this private name of torch, "
                                             + tested):
        private_name(torch.zeros(1), "_moved")
    with pytest.raises(MovedNameError, match=r"module torch\._moved is missing: .*" + tested):
        private_module("torch._moved")


def test_a_tensors_version_counter_and_the_exchange_of_storages():
    tensor = torch.zeros(4)
    before = tensors.version_counter(tensor)
    tensor.add_(1)
    assert tensors.version_counter(tensor) == before + 1
    assert tensors.can_exchange_storages()
    live, other = torch.zeros(4), torch.arange(4.0)
    tensors.exchange_storages(live.untyped_storage(), other.untyped_storage())
    assert torch.equal(live, torch.arange(4.0)) and torch.equal(other, torch.zeros(4))


def test_the_exit_hook_before_thread_pools_is_threadings():
    registered = []
    original = threading._register_atexit
    threading._register_atexit = registered.append
    try:
        distributed.at_exit_before_thread_pools(print)
    finally:
        threading._register_atexit = original
    assert registered == [print]


def test_a_destroyed_group_is_seen_through_c10ds_unregistering_functions(monkeypatch):
    c10d, calls = dist.distributed_c10d, []
    for name in ("_unregister_process_group", "_unregister_all_process_groups"):
        monkeypatch.setattr(c10d, name, lambda *args, name=name: calls.append(name))
    distributed.on_groups_destroyed(lambda: calls.append("seen"))
    distributed.on_groups_destroyed(lambda: calls.append("twice"))  # watched already: left as it is
    c10d._unregister_process_group("group")
    c10d._unregister_all_process_groups()
    assert calls == ["_unregister_process_group", "seen", "_unregister_all_process_groups", "seen"]


def distributed_names() -> dict:
    store = distributed.default_store()
    group = dist.new_group(timeout=datetime.timedelta(seconds=42))
    live = group in distributed.live_groups()
    timeout = distributed.group_timeout(group)
    dist.destroy_process_group(group)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dtensor = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    model = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)),
                                     use_orig_params=True, device_id=torch.device("cpu"))
    handle = fsdp1.flat_handle(model)
    return {"store": store.add("bcp/test", 1) > 0, "live": live, "gone": group not in distributed.live_groups(),
            "timeout": timeout,
            "local": tensors.local_shape_and_global_offset(dtensor),
            "params": [(fqn, tuple(shape)) for fqn, shape, _ in fsdp1.flat_parameters(handle.flat_param)],
            "shared": fsdp1.shared_parameters(handle.flat_param), "orig": fsdp1.uses_orig_params(handle),
            "buffers": [name for name, _ in fsdp1.persistent_buffers(model.module[1])]}


def test_the_distributed_tensor_and_fsdp1_names(ranks):
    first, second = ranks(2).run(distributed_names)
    for found in (first, second):
        assert found["store"] and found["live"] and found["gone"]
        assert found["timeout"] == 42.0
        assert found["shared"] == [] and found["orig"]
        assert found["params"] == \
            [("0.weight", (2, 3)), ("0.bias", (2,)), ("1.weight", (2,)), ("1.bias", (2,))]
        assert found["buffers"] == ["running_mean", "running_var", "num_batches_tracked"]
    assert first["local"] == ((3, 2), (0, 0)) and second["local"] == ((3, 2), (3, 0))
