"""Framework adapters: framework objects <-> flat state dicts of the core's value types."""

from bcp.adapters.base import FrameworkAdapter
from bcp.adapters.registry import adapter_for, register_adapter, registered_names
from bcp.adapters.torch_native import torch_adapters

for _adapter, _priority in torch_adapters():
    register_adapter(_adapter, priority=_priority)

__all__ = ["FrameworkAdapter", "adapter_for", "register_adapter", "registered_names"]
