"""``TRANSFORMERS_CHECKPOINT_ENGINE=bcp`` without ``import bcp_transformers`` in the user's code.

bcp-transformers' wheel puts a ``.pth`` file into site-packages whose one line, run when Python
starts, calls :func:`install` only while the variable says ``bcp``. ``install`` imports nothing
heavy: it adds an import hook that lets ``transformers.trainer`` import as usual and, right after
it has finished importing, imports ``bcp_transformers``, which routes the Trainer's checkpoint
methods through the switch (read again at every call). ``transformers`` imports its modules lazily,
so a program that never touches the Trainer imports neither it nor bcp because of this. This module
lives outside the ``bcp_transformers`` package so that importing it does not import transformers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_TRIGGER = "transformers.trainer"


def install() -> None:
    """Import ``bcp_transformers`` right after ``transformers.trainer`` is first imported (idempotent)."""
    if _TRIGGER in sys.modules:
        importlib.import_module("bcp_transformers")
    elif not any(isinstance(finder, _AfterTrainer) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTrainer())


class _AfterTrainer(importlib.abc.MetaPathFinder):
    """Finds ``transformers.trainer`` with the other finders and wraps its loader; removes itself once used."""

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> Any:
        if name != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenBcp(spec.loader)
        return spec


class _ThenBcp(importlib.abc.Loader):
    """The Trainer module's own loader, followed by ``import bcp_transformers``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__.loader = module.__loader__ = self._loader  # the module sees its own loader
        self._loader.exec_module(module)
        importlib.import_module("bcp_transformers")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
