"""Loader read workers in the tests start from a fork server, never forked from a training process.

A training process runs gloo, whose threads enter Python at the end of a collective (releasing its
tensors, whose Python objects the caller may have dropped), and each entry creates a thread state
under CPython's runtime lock without holding the GIL. In CPython 3.8 to 3.11 (3.11.7 here) a process
forked while another thread holds that lock takes it in the child before renewing it and waits
forever, before it runs a line of Python (python/cpython#112275; 3.12 renews it first). A loader
waits for its workers without a limit: a worker forked at that instant left a whole job hanging. A
fork server is one single-threaded process per training process that imports torch and the tests'
modules once: forks of it cannot inherit a held lock, and start as fast.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

#: What every worker needs, imported once by the fork server (missing ones are skipped there).
PRELOAD = ("torch", "torchdata.stateful_dataloader")


def start_from_fork_server(*modules: str) -> None:
    """Make this process's loaders (any process started from multiprocessing's default context)
    start their workers from a fork server, started now, that has imported torch, torchdata and
    ``modules`` (those the workers unpickle their datasets and functions from). Each worker also
    imports this process's ``__main__`` script anew, as multiprocessing does for every child it does
    not fork from the parent; a process whose script imports much starts from ``-c`` instead
    (``lightning_launch``)."""
    multiprocessing.set_start_method("forkserver", force=True)
    _start(modules)


def fork_server(*modules: str) -> BaseContext:
    """The fork server's context, for one loader's ``multiprocessing_context`` in a process whose
    default start method stays as it is."""
    _start(modules)
    return multiprocessing.get_context("forkserver")


def _start(modules: tuple[str, ...]) -> None:
    multiprocessing.set_forkserver_preload([*PRELOAD, *modules])
    # Python 3.11's fork server imports its preload with the interpreter's default path, not this
    # process's (the tests' folders are on it): the server gets it through its environment, and
    # every worker would otherwise import the tests' modules itself (seconds apiece).
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    try:
        forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous
