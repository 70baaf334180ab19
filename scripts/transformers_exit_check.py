"""Does every process of a Trainer run exit cleanly? Fresh launches with each checkpoint engine.

Each launch starts 2 fresh gloo processes (the environment ``torchrun`` gives them) that train the
tiny GPT-2 of ``tests/transformers/trainer_helpers.py`` for one epoch, saving at steps 6 and 12,
with ``TRANSFORMERS_CHECKPOINT_ENGINE`` set to the engine; it records every process's exit code and
whether its stderr holds an abort (``terminate called ...``) after the work. Not part of
``make test``: a launch costs 10-20 s.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/transformers_exit_check.py [--launches 6]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = 2
WORKER = ("import sys; sys.path.insert(0, {helpers!r}); from trainer_helpers import fit; "
          "run = fit({output!r}, {engine!r}); print('trained to step', run['end']['step'], flush=True)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(engine: str) -> list[tuple[int, bool, bool]]:
    """(exit code, finished its training, aborted) of each process of one launch."""
    port = free_port()
    with tempfile.TemporaryDirectory() as output:
        code = WORKER.format(helpers=str(ROOT / "tests" / "transformers"), output=output, engine=engine)
        processes = []
        for rank in range(PROCESSES):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(PROCESSES),
                   "LOCAL_WORLD_SIZE": str(PROCESSES), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            processes.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))
        outcomes = []
        for process in processes:
            out, err = process.communicate(timeout=600)
            outcomes.append((process.returncode, "trained to step 12" in out, "terminate called" in err))
        return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=6)
    parser.add_argument("--engines", nargs="+", default=["transformers", "bcp"])
    arguments = parser.parse_args()
    failed = 0
    for engine in arguments.engines:
        for number in range(1, arguments.launches + 1):
            outcomes = launch(engine)
            failed += any(code != 0 or aborted or not finished for code, finished, aborted in outcomes)
            print(f"{engine} launch {number}: " + ", ".join(
                f"rank {rank} exit {code}{'' if finished else ' (did not finish)'}{' aborted' if aborted else ''}"
                for rank, (code, finished, aborted) in enumerate(outcomes)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
