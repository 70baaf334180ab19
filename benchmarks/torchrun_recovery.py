"""Recovery under torchrun: ``examples/every_step_torchrun.py`` (2 CPU ranks posing as 2 nodes, a
memory-tier save every step) runs under ``torchrun --max-restarts=1``; a rank is SIGKILLed at a
step, and the time from the kill to the first step completed after it is broken down; beside it the
same job with no checkpoint, whose restart has nothing to load and starts from step 1.

    .venv/bin/python benchmarks/torchrun_recovery.py [--rounds 3] [--hidden 256]

(torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, ``docs/memory-tier.md``.)

The parts, from the workers' lines and torchrun's log (the clocks of one machine):
- detection: the kill to the agent's log line naming the worker's exit code (it polls every
  ``--monitor-interval``, 0.1 s);
- restart: to the restarted worker's first line of Python (the agent stops the survivors, meets its
  rendezvous again and starts the workers);
- imports: to torch and bcp imported;
- process group: to ``init_process_group`` returned (gloo's setup);
- model: to the model and optimizer built (FSDP2);
- load: to ``bcp.load`` from the tier returned (nothing without a checkpoint);
- first step: to the first step after the restart completed.
Each part ends at the latest rank. Medians over the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "every_step_torchrun.py")
PARTS = ("detection", "restart", "imports", "process group", "model", "load", "first step")
KILL_AT = 20
STEPS = 40


def agent_time(line: str) -> float:
    """The time of a torchrun log line (``E1129 06:24:16.575000 pid file:line] ...``, local time)."""
    stamp = re.search(r"^[EWI](\d{4} \d\d:\d\d:\d\d\.\d+)", line).group(1)
    when = datetime.datetime.strptime(f"{datetime.date.today().year}{stamp}", "%Y%m%d %H:%M:%S.%f")
    return when.timestamp()


def one_recovery(checkpoint: bool, hidden: int) -> dict[str, float]:
    """One job killed at step ``KILL_AT``; the seconds of each part of its recovery."""
    with tempfile.TemporaryDirectory(prefix="bcp-torchrun-recovery-") as tier_dir:
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node=2",
                   "--max-restarts=1", "--monitor-interval=0.1", EXAMPLE, "--tier-dir", tier_dir, "--nodes", "a,b",
                   "--steps", str(STEPS), "--hidden", str(hidden)] + ([] if checkpoint else ["--no-checkpoint"])
        job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines, victim, killed_at = [], None, None
        for line in job.stdout:
            lines.append(line)
            if killed_at is None:
                if m := re.match(r"\[rank 1\] attempt 0 pid (\d+)", line):
                    victim = int(m.group(1))
                elif line.startswith(f"[rank 1] step {KILL_AT} "):
                    killed_at = time.time()
                    os.kill(victim, signal.SIGKILL)
        if job.wait() != 0 or killed_at is None:
            raise SystemExit("".join(lines))
    after = lines[next(i for i, line in enumerate(lines) if "failed (exitcode: -9)" in line):]

    def latest(pattern: str) -> float:
        return max(float(m.group(1)) for line in after if (m := re.search(pattern, line)))

    ends = [agent_time(next(line for line in after if "failed (exitcode: -9)" in line)),
            latest(r"attempt 1 pid \d+ started (\S+)"), latest(r"attempt 1 pid \d+ started \S+ imported (\S+)"),
            latest(r"process group (\S+)"), latest(r"built (\S+)"), latest(r"loaded (\S+)")]
    first_step = min(int(m.group(1)) for line in after if (m := re.search(r"\] step (\d+) ", line)))
    ends.append(latest(rf"\] step {first_step} loss \S+ done (\S+)"))
    starts = [killed_at] + ends[:-1]
    return {part: end - start for part, start, end in zip(PARTS, starts, ends)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's width (model + AdamW: 12 * hidden^2 bytes)")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"memory tier, every step": [], "no checkpoint": []}
    for _ in range(args.rounds):  # interleaved: a load on the machine weighs on both alike
        runs["memory tier, every step"].append(one_recovery(checkpoint=True, hidden=args.hidden))
        runs["no checkpoint"].append(one_recovery(checkpoint=False, hidden=args.hidden))
    print(f"| job (hidden {args.hidden}, {args.rounds} rounds, medians, s) | " + " | ".join(PARTS) + " | kill to first step |")
    print("| --- " * (len(PARTS) + 2) + "|")
    for name, parts in runs.items():
        medians = [statistics.median(run[part] for run in parts) for part in PARTS]
        total = statistics.median(sum(run.values()) for run in parts)
        print(f"| {name} | " + " | ".join(f"{m:.2f}" for m in medians) + f" | {total:.2f} |")


if __name__ == "__main__":
    main()
