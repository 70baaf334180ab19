"""The build backend of bcp-transformers: setuptools, plus ``bcp_transformers_autoload.pth`` at the
root of every wheel it builds, normal or editable (PEP 660).

Python runs a ``.pth`` line that starts with ``import`` when it starts. This one only reads an
environment variable; when ``TRANSFORMERS_CHECKPOINT_ENGINE`` is ``bcp`` it imports
``bcp_transformers_autoload``, which waits for the Trainer to be imported. A build backend runs
from its own folder (``backend-path`` must lie inside the project), so it cannot share
bcp-accelerate's backend, which does the same for its own ``.pth``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # every other PEP 517/660 hook, unchanged

PTH_NAME = "bcp_transformers_autoload.pth"
# One line, checked at every interpreter start: a dictionary lookup while the variable is unset.
PTH_LINE = ('import os; os.environ.get("TRANSFORMERS_CHECKPOINT_ENGINE", "").strip().lower() == "bcp" '
            'and __import__("bcp_transformers_autoload").install()\n')


def build_wheel(wheel_directory: str, config_settings: dict | None = None,
                metadata_directory: str | None = None) -> str:
    return _with_pth(wheel_directory, _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory))


def build_editable(wheel_directory: str, config_settings: dict | None = None,
                   metadata_directory: str | None = None) -> str:
    return _with_pth(wheel_directory,
                     _setuptools.build_editable(wheel_directory, config_settings, metadata_directory))


def _with_pth(wheel_directory: str, name: str) -> str:
    """The wheel ``name`` rewritten with the ``.pth`` file at its root, recorded in its RECORD."""
    wheel, data = os.path.join(wheel_directory, name), PTH_LINE.encode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(wheel + ".part", "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            content = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                content += f"{PTH_NAME},sha256={digest},{len(data)}\n".encode()
            target.writestr(item, content)
        target.writestr(PTH_NAME, data)
    os.replace(wheel + ".part", wheel)
    return name
