"""How long bcp waits for other ranks, and how it waits where torch would wait silently.

Every wait across ranks is bounded by the coordinator's timeout and, still waiting after
``warn_after`` seconds, logs a WARNING naming the ranks it waits for: a save or load called on some
ranks only (``if rank == 0: bcp.save(...)``) is then seen within seconds, not when the timeout ends.
Both are read at each use from the environment where the caller gave none: ``BCP_TIMEOUT_S`` and
``BCP_WARN_AFTER_S``.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Callable

import torch.distributed as dist

#: Seconds a rank waits for the others before it warns, naming those it waits for.
WARN_AFTER_ENV = "BCP_WARN_AFTER_S"
DEFAULT_WARN_AFTER_S = 30.0
#: Seconds bcp waits for the other ranks before it fails (default: the process group's timeout
#: for the torch.distributed coordinator, 600 for the gRPC one).
TIMEOUT_ENV = "BCP_TIMEOUT_S"
# A wait looks at the store at once, then less and less often: ranks that arrive together cost a
# few looks, and a rank waiting long sends the store's host about one request a second.
_FIRST_LOOK_S = 0.005
_LAST_LOOK_S = 1.0


def warn_after_from_env() -> float | None:
    """``BCP_WARN_AFTER_S`` (default 30); None where it is 0 or negative: never warn."""
    seconds = _seconds(WARN_AFTER_ENV, DEFAULT_WARN_AFTER_S)
    return seconds if seconds > 0 else None


def timeout_from_env(default: float) -> float:
    """``BCP_TIMEOUT_S`` where it is set (a positive number of seconds), else ``default``."""
    seconds = _seconds(TIMEOUT_ENV, default)
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} is not a positive number of seconds")
    return seconds


def wait_for(ready: Callable[[], bool], timeout: float, warn_after: float | None,
             warn: Callable[[float], None], block: Callable[[float], bool] | None = None) -> bool:
    """Whether ``ready()`` became true within ``timeout`` seconds. It is looked at until then (or,
    given ``block``, a blocking wait of its own for the remaining seconds, once ``warn_after`` has
    passed: a rank that waits long then sends the store no more requests); still waiting after
    ``warn_after`` seconds, ``warn(seconds waited)`` is called once."""
    start = time.monotonic()
    pause = _FIRST_LOOK_S
    warned = warn_after is None or warn_after >= timeout
    while not ready():
        waited = time.monotonic() - start
        if waited >= timeout:
            return False
        if not warned and waited >= warn_after:
            warn(warn_after)
            warned = True
        if warned and block is not None:
            return block(timeout - waited)
        next_mark = timeout if warned else min(timeout, warn_after)
        time.sleep(max(0.0, min(pause, next_mark - waited)))
        pause = min(pause * 2, _LAST_LOOK_S)
    return True


def store_keys_set(store: Any, keys: list[str]) -> Callable[[], bool]:
    """For :func:`wait_for`: whether every one of ``keys`` is set in ``store``."""
    return lambda: store.check(keys)


def store_wait(store: Any, keys: list[str]) -> Callable[[float], bool]:
    """For :func:`wait_for`: the store's own blocking wait for ``keys``, for some seconds; whether
    they were all set by then (a lost store's host raises, as torch raises it)."""
    def block(seconds: float) -> bool:
        try:
            store.wait(keys, datetime.timedelta(seconds=max(seconds, 0.001)))
            return True
        except dist.DistStoreError:  # torch's timeout, or a store error that the check below raises again
            return store.check(keys)
    return block


def ranks_text(ranks: "list[int] | tuple[int, ...]") -> str:
    """Ranks with consecutive runs shortened: ``0-3, 8``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
