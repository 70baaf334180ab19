"""The text users read speaks of the product, not of how it was built: docs, tests, benchmarks and
packages cite no internal issue numbers and no work sessions (a user has neither; the history of a
change belongs in ``git log`` and ``CHANGELOG.md``). The check runs ``git grep`` over the checkout,
so it needs one: from an unpacked archive it is skipped, and says so."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FOLDERS = ("docs", "tests", "benchmarks", "packages")
#: "issue", "issue #" or "session" followed by a number: references a user cannot follow.
WORK_LOG = r"session[ -][0-9]|issue #?[0-9]"


def _checkout_root() -> str | None:
    if shutil.which("git") is None:
        return None
    done = subprocess.run(["git", "-C", ROOT, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=False)
    top = done.stdout.strip()
    return top if done.returncode == 0 and os.path.samefile(top, ROOT) else None


def test_docs_tests_benchmarks_and_packages_cite_no_issue_or_session():
    if _checkout_root() is None:
        pytest.skip(f"{ROOT} is not a git checkout (or git is missing): nothing to grep")
    # Tracked files and new ones not yet added (but not ignored ones: .venv, results, caches).
    done = subprocess.run(["git", "-C", ROOT, "grep", "--untracked", "-I", "-n", "-i", "-E", WORK_LOG, "--", *FOLDERS],
                          capture_output=True, text=True, check=False)
    assert done.returncode in (0, 1), f"git grep failed: {done.stderr}"
    assert done.stdout == "", ("internal issue or session references in user-facing text (say what the thing is "
                               "and why; history goes to CHANGELOG.md):\n" + done.stdout)
