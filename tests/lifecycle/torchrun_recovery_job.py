"""``examples/every_step_torchrun.py`` as torchrun runs it, with one fault the test cannot cause from
outside in time: ``--lose-node NODE`` removes that node's tier folder when the workers are restarted,
before they load (a node replaced by an empty one between the kill and the restart). Every rank of
that node removes it before it starts, so the folder is gone by the time any of them counts what its
node holds in the load."""

from __future__ import annotations

import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import every_step_torchrun  # noqa: E402


def lose_node_folder(argv: list[str]) -> list[str]:
    if "--lose-node" not in argv:
        return argv
    at = argv.index("--lose-node")
    node = argv[at + 1]
    argv = argv[:at] + argv[at + 2:]
    nodes = argv[argv.index("--nodes") + 1].split(",")
    rank = int(os.environ["RANK"])
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" and nodes[rank] == node:
        # ignore_errors: the node's other ranks remove the same files at the same time
        shutil.rmtree(os.path.join(argv[argv.index("--tier-dir") + 1], f"node-{node}"), ignore_errors=True)
        every_step_torchrun.say(f"[rank {rank}] removed the folder of node {node}")
    return argv


if __name__ == "__main__":
    sys.argv[1:] = lose_node_folder(sys.argv[1:])
    every_step_torchrun.main()
