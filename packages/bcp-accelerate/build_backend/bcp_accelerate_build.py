"""The build backend of bcp-accelerate: setuptools, plus one file at the root of every wheel it
builds, normal or editable (PEP 660): ``bcp_accelerate_autoload.pth``.

Python runs a ``.pth`` line that starts with ``import`` when it starts, for every ``.pth`` file in
site-packages. This one only reads an environment variable; when ``ACCELERATE_CHECKPOINT_ENGINE``
is ``bcp`` it imports ``bcp_accelerate_autoload``, which waits for accelerate to be imported (see
that module). setuptools installs no file beside the packages in site-packages in an editable
install (neither ``data_files`` nor ``build_py`` outputs reach it portably), so the file is added to
the finished wheel here, with its line in the wheel's ``RECORD``.
bcp-transformers' backend does the same for its own ``.pth``: pip runs a backend from inside its
project (``backend-path``) in an isolated environment holding only ``setuptools``, so the two
cannot share one module.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # every other PEP 517/660 hook, unchanged

PTH_NAME = "bcp_accelerate_autoload.pth"
# One line, checked at every interpreter start: a dictionary lookup while the variable is unset.
PTH_LINE = ('import os; os.environ.get("ACCELERATE_CHECKPOINT_ENGINE", "").strip().lower() == "bcp" '
            'and __import__("bcp_accelerate_autoload").install()\n')


def build_wheel(wheel_directory: str, config_settings: dict | None = None,
                metadata_directory: str | None = None) -> str:
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    _add_to_wheel(os.path.join(wheel_directory, name), PTH_NAME, PTH_LINE.encode())
    return name


def build_editable(wheel_directory: str, config_settings: dict | None = None,
                   metadata_directory: str | None = None) -> str:
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    _add_to_wheel(os.path.join(wheel_directory, name), PTH_NAME, PTH_LINE.encode())
    return name


def _add_to_wheel(wheel: str, name: str, data: bytes) -> None:
    """Rewrite ``wheel`` with ``name`` at its root and recorded in its RECORD (sha256, size)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rewritten = wheel + ".part"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            content = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                content += f"{name},sha256={digest},{len(data)}\n".encode()
            target.writestr(item, content)
        target.writestr(name, data)
    os.replace(rewritten, wheel)
