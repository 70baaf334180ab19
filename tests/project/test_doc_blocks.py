"""Every ``python`` block of README.md and docs/*.md is tested, so that a snippet cannot drift from
the code: it runs here (as written, or after a named setup), or it names the test that covers it
(see ``tests/doc_blocks.py`` for the markers)."""

from __future__ import annotations

import importlib
import re

import pytest

import doc_blocks
from doc_blocks import ROOT, Block, every_block

BLOCKS = every_block()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(block: Block, tmp_path, monkeypatch):
    code = compile(block.code, f"{block.doc}:{block.line}", "exec")
    if block.how == "covered by":
        assert _test_exists(block.file, block.name), f"{block.id} names {block.file}::{block.name}, which does not exist"
        return
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    if block.how == "given":
        module = block.file.removeprefix("tests/").removesuffix(".py").replace("/", ".")
        scope.update(getattr(importlib.import_module(module), block.name)(tmp_path))
    exec(code, scope)


def _test_exists(file: str, name: str) -> bool:
    path = ROOT / file
    return path.is_file() and re.search(rf"^def {name}\(", path.read_text(), re.M) is not None


def test_a_marker_naming_a_missing_test_is_caught(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("text\n<!-- doc-test: covered by tests/core/test_architecture.py::test_nothing_by_that_name -->\n"
                   "```python\nx = 1\n```\n\n```python\ny = 2\n```\n")
    marked, plain = doc_blocks.python_blocks(doc)
    assert (marked.how, marked.file, marked.name, marked.line) == (
        "covered by", "tests/core/test_architecture.py", "test_nothing_by_that_name", 3)
    assert not _test_exists(marked.file, marked.name)
    assert _test_exists(marked.file, "test_no_import_cycles")
    assert plain.how is None and plain.code == "y = 2\n"
