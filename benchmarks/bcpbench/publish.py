"""The generated blocks of ``docs/benchmarks.md``. Each block sits between two markers,

    <!-- bench:NAME begin: written by `make bench-docs` -->
    <!-- bench:NAME end -->

and holds what ``report.blocks`` renders under NAME from one full run; everything outside the
markers is written by hand (measurements of other scripts, with their own command and date)."""

from __future__ import annotations

import re

PROFILE = "full"


class PublishError(Exception):
    """The run or the page cannot be published as asked; the message says why."""


def begin_marker(name: str) -> str:
    return f"<!-- bench:{name} begin: written by `make bench-docs` -->"


def end_marker(name: str) -> str:
    return f"<!-- bench:{name} end -->"


def marked_names(page: str) -> list[str]:
    """The names of the blocks the page has, in order."""
    return re.findall(r"<!-- bench:([\w-]+) begin", page)


def replace_blocks(page: str, bodies: dict[str, list[str]]) -> str:
    """``page`` with every marked block's lines replaced by its body. Every block of the page must
    have a body, with lines, and every body a block: a run that lacks a path (``--only``) or a page
    that lost a marker would otherwise publish a page that mixes two runs without saying so."""
    names = marked_names(page)
    missing = [name for name in bodies if name not in names]
    if missing:
        raise PublishError(f"the page has no block named {', '.join(missing)} (markers: {begin_marker('NAME')})")
    empty = [name for name in names if not bodies.get(name)]
    if empty:
        raise PublishError(f"the run measured nothing for {', '.join(empty)}: publish a run of every group")
    for name in names:
        start, end = begin_marker(name), end_marker(name)
        if page.count(start) != 1 or page.count(end) != 1 or page.index(start) > page.index(end):
            raise PublishError(f"block {name}: expected one {start!r} before one {end!r}")
        head, rest = page.split(start, 1)
        _, tail = rest.split(end, 1)
        page = head + start + "\n" + "\n".join(bodies[name]).strip("\n") + "\n" + end + tail
    return page
