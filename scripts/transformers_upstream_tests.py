"""transformers' own checkpoint and resume tests, run with the Trainer's engine and with bcp.

Their code is not part of this repository: ``retrieve`` copies it into ``build/transformers-upstream/``
(ignored by git), from GitHub at the installed version's tag or from a local checkout of transformers;
``run`` runs the retrieved cases twice, with ``TRANSFORMERS_CHECKPOINT_ENGINE=transformers`` and
``=bcp`` (the environment variable alone, no code change), and writes each case's outcome under both
engines to ``tests/transformers/upstream/outcomes.txt``. Not part of ``make test``: it needs the
retrieved files (and for a few cases the Hugging Face Hub); without them ``run`` says what to do.

    .venv/bin/python scripts/transformers_upstream_tests.py retrieve [--from CHECKOUT] [--tag v5.24.0]
    .venv/bin/python scripts/transformers_upstream_tests.py run
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / "build" / "transformers-upstream"
OUTCOMES = ROOT / "tests" / "transformers" / "upstream" / "outcomes.txt"
#: The Trainer's checkpoint and resume tests and what they import, as paths of the transformers repository.
FILES = (
    "tests/__init__.py",
    "tests/trainer/__init__.py",
    "tests/trainer/trainer_test_utils.py",
    "tests/trainer/test_trainer_checkpointing.py",
    "tests/trainer/test_trainer_resume.py",
)
TESTS = [name for name in FILES if Path(name).name.startswith("test_")]
ENGINES = ("transformers", "bcp")
RAW = "https://raw.githubusercontent.com/huggingface/transformers/{tag}/{path}"


def retrieve(tag: str, checkout: Path | None) -> None:
    for name in FILES:
        target = UPSTREAM / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if checkout is not None:
            shutil.copyfile(checkout / name, target)
        else:
            url = RAW.format(tag=tag, path=name)
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    target.write_bytes(response.read())
            except OSError as error:
                raise SystemExit(f"cannot download {url} ({error}): copy them from a checkout with --from") from error
    (UPSTREAM / "SOURCE").write_text(f"{checkout or RAW.format(tag=tag, path='')}\n")
    print(f"retrieved {len(FILES)} files into {UPSTREAM}")


def run_engine(engine: str) -> dict[str, str]:
    """Each case's outcome (passed, failed, error, skipped) with ``engine``, in a fresh pytest process."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        env = {**os.environ, "TRANSFORMERS_CHECKPOINT_ENGINE": engine, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(UPSTREAM),
                   "-o", "addopts=", f"--junitxml={report}", *TESTS]
        subprocess.run(command, cwd=UPSTREAM, env=env, check=False)
        return outcomes_of(report)


def outcomes_of(report: Path) -> dict[str, str]:
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        found = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(found[0] if found else "",
                                                                                       "passed")
    return outcomes


def run() -> int:
    missing = [name for name in FILES if not (UPSTREAM / name).is_file()]
    if missing:
        print(f"not retrieved ({', '.join(missing)}): run `{Path(__file__).name} retrieve` first", file=sys.stderr)
        return 2
    results = {engine: run_engine(engine) for engine in ENGINES}
    names = sorted(set().union(*results.values()))
    source = (UPSTREAM / "SOURCE").read_text().splitlines() if (UPSTREAM / "SOURCE").exists() else ["unknown"]
    lines = [f"# transformers {importlib.metadata.version('transformers')}; the tests from:",
             *(f"#   {line}" for line in source), f"# case  {'  '.join(ENGINES)}  (* where they differ)"]
    for name in names:
        row = [results[engine].get(name, "absent") for engine in ENGINES]
        lines.append(f"{name}  {'  '.join(row)}{'  *' if len(set(row)) > 1 else ''}")
    OUTCOMES.parent.mkdir(parents=True, exist_ok=True)
    OUTCOMES.write_text("\n".join(lines) + "\n")
    differ = sum(line.endswith("*") for line in lines)
    print(f"{len(names)} cases, {differ} differ between the engines; written to {OUTCOMES.relative_to(ROOT)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("retrieve", help="copy the test files into build/transformers-upstream/")
    fetch.add_argument("--tag", default=f"v{importlib.metadata.version('transformers')}")
    fetch.add_argument("--from", dest="checkout", type=Path, help="a local checkout of transformers at the tag")
    commands.add_parser("run", help="run them with each engine and write the outcomes")
    arguments = parser.parse_args()
    if arguments.command == "retrieve":
        retrieve(arguments.tag, arguments.checkout)
        return 0
    return run()


if __name__ == "__main__":
    sys.exit(main())
