"""``ACCELERATE_CHECKPOINT_ENGINE=bcp`` without ``import bcp_accelerate`` in the user's code.

bcp-accelerate's wheel puts a ``.pth`` file into site-packages whose one line, run when Python
starts, calls :func:`install` only while the variable says ``bcp``. ``install`` imports nothing
heavy: it adds bcp-core's import hook (``bcp_after_import``), which lets accelerate import as usual
and, right after ``accelerate`` has finished importing, imports ``bcp_accelerate``, which routes
``Accelerator.save_state``/``load_state`` through the switch (read again at every call). A program
that never imports accelerate never imports torch, accelerate or bcp because of this. This module
lives outside the ``bcp_accelerate`` package so that importing it does not import accelerate.
"""

from __future__ import annotations

import importlib

from bcp_after_import import after_import


def install() -> None:
    """Import ``bcp_accelerate`` right after ``accelerate`` is first imported (idempotent)."""
    after_import("accelerate", lambda: importlib.import_module("bcp_accelerate"))
