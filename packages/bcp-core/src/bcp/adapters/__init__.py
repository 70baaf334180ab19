"""Framework adapters: framework objects <-> flat state dicts of the core's value types."""

from bcp.adapters.base import FrameworkAdapter
from bcp.adapters.fsdp1 import FSDP1Adapter
from bcp.adapters.registry import adapter_for, register_adapter, registered_names
from bcp.adapters.torch_native import torch_adapters

register_adapter(FSDP1Adapter(), priority=40)
for _adapter, _priority in torch_adapters():
    register_adapter(_adapter, priority=_priority)

__all__ = ["FrameworkAdapter", "adapter_for", "register_adapter", "registered_names"]
