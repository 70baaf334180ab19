"""The registry of framework adapters: integrations add theirs here, the core never names them."""

from __future__ import annotations

from typing import Any, Mapping

from bcp.adapters.base import FrameworkAdapter
from bcp.errors import AdapterError

_ADAPTERS: list[tuple[int, FrameworkAdapter]] = []


def register_adapter(adapter: FrameworkAdapter, *, priority: int = 0) -> None:
    """Make ``adapter`` available as ``framework=adapter.name`` and to detection, where adapters
    with a higher ``priority`` are asked first (specific layouts before generic ones)."""
    global _ADAPTERS
    _ADAPTERS = [(p, a) for p, a in _ADAPTERS if a.name != adapter.name]
    _ADAPTERS.append((priority, adapter))
    _ADAPTERS.sort(key=lambda pa: -pa[0])


def registered_names() -> list[str]:
    return [a.name for _, a in _ADAPTERS]


def adapter_for(state: Mapping[str, Any], framework: str | None) -> FrameworkAdapter:
    """The adapter named ``framework`` (checked against the objects), or the detected one."""
    if framework is not None:
        adapter = next((a for _, a in _ADAPTERS if a.name == framework), None)
        if adapter is None:
            raise AdapterError(f"unknown framework {framework!r}; registered: {registered_names()}")
        if not adapter.detect(state):
            detected = next((a.name for _, a in _ADAPTERS if a.detect(state)), None)
            raise AdapterError(
                f"framework={framework!r} was requested but the model/optimizer do not match it"
                + (f" (they look like {detected!r})" if detected else ""))
        return adapter
    for _, adapter in _ADAPTERS:
        if adapter.detect(state):
            return adapter
    raise AdapterError(f"no registered adapter recognises the model; registered: {registered_names()}")
