"""Run a callback right after a named module is first imported: the import hook behind the
integrations' no-code-change switches (an installed ``.pth`` line calls :func:`after_import` while
Python starts, and the integration is imported only once its framework is).

A top-level module of bcp-core beside the ``bcp`` package, not inside it: importing anything under
``bcp`` imports torch, and a program that never imports the framework must import neither because
of a ``.pth`` line. This module imports only the standard library.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["after_import"]


def after_import(module_name: str, callback: Callable[[], Any]) -> None:
    """Call ``callback()`` right after ``module_name`` has finished its first import, or now if it
    already has. Once per module name: a second call for the same name while the first waits adds
    nothing."""
    if module_name in sys.modules:
        callback()
    elif not any(isinstance(finder, _Waiting) and finder.module_name == module_name for finder in sys.meta_path):
        sys.meta_path.insert(0, _Waiting(module_name, callback))


class _Waiting(importlib.abc.MetaPathFinder):
    """Finds ``module_name`` with the other finders and wraps its loader; removes itself once used."""

    def __init__(self, module_name: str, callback: Callable[[], Any]) -> None:
        self.module_name = module_name
        self._callback = callback

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> Any:
        if name != self.module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCallback(spec.loader, self._callback)
        return spec


class _ThenCallback(importlib.abc.Loader):
    """The module's own loader, followed by the callback."""

    def __init__(self, loader: Any, callback: Callable[[], Any]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__.loader = module.__loader__ = self._loader  # the module sees its own loader
        self._loader.exec_module(module)
        self._callback()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
