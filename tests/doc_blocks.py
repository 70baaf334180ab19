"""The fenced ``python`` blocks of README.md and docs/*.md, each with its test marker.

Every block is a test (``tests/project/test_doc_blocks.py``). The line right before a block's fence
may say how:

- no marker: the block runs as written, in an empty folder, in a fresh namespace;
- ``<!-- doc-test: given tests/doc_setups.py::NAME -->``: it runs after ``NAME(folder)`` (a
  function there) made the names it uses (a model, an optimizer, a checkpoint path);
- ``<!-- doc-test: covered by tests/<file>.py::<test> -->``: a fragment that needs several ranks,
  a server or a framework's job; it must compile, and the named test must exist (that test runs
  the block itself or the calls it shows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"<!-- doc-test: (given|covered by) (tests/[\w/.]+\.py)::(\w+) -->")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    code: str
    #: None (runs as written), "given" or "covered by".
    how: str | None
    #: The test file (repository-relative) and function the marker names.
    file: str | None
    name: str | None

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.fullmatch(before.strip())
        line = text.count("\n", 0, match.start()) + 1
        how, file, name = marker.groups() if marker else (None, None, None)
        blocks.append(Block(doc, line, match.group(1), how, file, name))
    return blocks


def every_block() -> list[Block]:
    return [block for doc in doc_files() for block in python_blocks(doc)]


def block_covered_by(test_file: str, test_name: str) -> Block:
    """The one block whose marker names this test (for the test that runs it)."""
    found = [b for b in every_block() if (b.file, b.name) == (test_file, test_name)]
    assert len(found) == 1, f"{len(found)} doc blocks name {test_file}::{test_name}"
    return found[0]
