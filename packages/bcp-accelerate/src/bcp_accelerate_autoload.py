"""``ACCELERATE_CHECKPOINT_ENGINE=bcp`` without ``import bcp_accelerate`` in the user's code.

bcp-accelerate's wheel puts a ``.pth`` file into site-packages whose one line, run when Python
starts, calls :func:`install` only while the variable says ``bcp``. ``install`` imports nothing
heavy: it adds an import hook that lets accelerate import as usual and, right after ``accelerate``
has finished importing, imports ``bcp_accelerate``, which routes ``Accelerator.save_state``/
``load_state`` through the switch (read again at every call). A program that never imports
accelerate never imports torch, accelerate or bcp because of this. This module lives outside the
``bcp_accelerate`` package so that importing it does not import accelerate.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from collections.abc import Sequence
from typing import Any

_TRIGGER = "accelerate"


def install() -> None:
    """Import ``bcp_accelerate`` right after ``accelerate`` is first imported (idempotent)."""
    if not any(isinstance(finder, _AfterAccelerate) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterAccelerate())


class _AfterAccelerate(importlib.abc.MetaPathFinder):
    """Finds ``accelerate`` with the other finders and wraps its loader; removes itself once used."""

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> Any:
        if name != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenBcp(spec.loader)
        return spec


class _ThenBcp(importlib.abc.Loader):
    """``accelerate``'s own loader, followed by ``import bcp_accelerate``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__.loader = module.__loader__ = self._loader  # accelerate sees its own loader
        self._loader.exec_module(module)
        importlib.import_module("bcp_accelerate")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
