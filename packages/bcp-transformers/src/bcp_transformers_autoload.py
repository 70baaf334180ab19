"""``TRANSFORMERS_CHECKPOINT_ENGINE=bcp`` without ``import bcp_transformers`` in the user's code.

bcp-transformers' wheel puts a ``.pth`` file into site-packages whose one line, run when Python
starts, calls :func:`install` only while the variable says ``bcp``. ``install`` imports nothing
heavy: it adds bcp-core's import hook (``bcp_after_import``), which lets ``transformers.trainer``
import as usual and, right after it has finished importing, imports ``bcp_transformers``, which
routes the Trainer's checkpoint methods through the switch (read again at every call).
``transformers`` imports its modules lazily, so a program that never touches the Trainer imports
neither it nor bcp because of this. This module lives outside the ``bcp_transformers`` package so
that importing it does not import transformers.
"""

from __future__ import annotations

import importlib

from bcp_after_import import after_import


def install() -> None:
    """Import ``bcp_transformers`` right after ``transformers.trainer`` is first imported (idempotent)."""
    after_import("transformers.trainer", lambda: importlib.import_module("bcp_transformers"))
