"""bcp's own gloo groups: the CPU channel a ``TorchCoordinator`` exchanges on.

A side group is built over the world's store by its members alone, so ranks outside it take no
part (two data-parallel groups each save on their own), and it is registered nowhere in torch, so
it never shifts the names torch gives the user's own groups. It lives while some live process
group it was handed out for does, and is shut down (gloo's threads joined, its sockets closed) by
:func:`release_side_groups` when those groups are destroyed, at ``bcp.shutdown()`` and at exit
(``bcp.api.runtime`` calls it at each), always while the interpreter is fully alive. A gloo group
left to the interpreter's final teardown can abort the process: its worker threads may still hold
tensors whose release needs the GIL, which a finalizing interpreter no longer hands out.

A transport failure releases the group at once, so the other members' next exchange fails too
instead of waiting out the timeout; each member then reports the failure on the store and names
the members that did not report within a short grace (dead, hung or not calling bcp).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import re
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from bcp.coord.forked_children import left_alone_in_forked_children
from bcp.coord.waiting import ranks_text, store_keys_set, store_wait, wait_for
from bcp.errors import DistributedError
from bcp.torch_internals.distributed import default_store, live_groups

# How long a member that saw a failure waits for the others' reports before naming the silent ones.
REPORT_GRACE_S = 5.0
# A member still waiting in an exchange after this long marks itself present for a roll call.
_PRESENT_AFTER_S = 0.5
_POLL_S = 0.05
# gloo prefixes its messages with the C++ source position: "[.../pair.cc:537] Read error ...".
_SOURCE_PREFIX = re.compile(r"^\[[^\]]+:\d+\]\s*")
# ... and ends them with generic advice ("This is typically caused by ...").
_GLOO_ADVICE = re.compile(r"\s*This is typically caused by .*$")

_log = logging.getLogger("bcp")
_lock = threading.Lock()
# (members, timeout, channel) -> the side group handed out for them while one of its process groups lives.
_live: dict[tuple[tuple[int, ...], float, str], "SideGroup"] = {}


class SideGroup:
    """A gloo group over ``members`` (global ranks, sorted) on one named channel; ``rank`` is this
    process's index in ``members``. Every member constructs it, in the same order as the others."""

    def __init__(self, members: tuple[int, ...], timeout: float, channel: str,
                 warn_after: float | None = None) -> None:
        self.members = members
        self.timeout = timeout
        self.channel = channel
        self.rank = members.index(dist.get_rank())
        self.size = len(members)
        self._parents: list[weakref.ref] = []
        self._exchanges = 0  # exchanges this member entered: the same count on every member
        #: Shut down for good (its process groups destroyed, bcp.shutdown(), exit): never rebuilt.
        self.closed = False
        self.backend: Any = None
        self.store: Any = None
        try:
            # Members meet under a prefix of their own: a counter per (members, timeout, channel)
            # numbers each re-creation, and every member adds to it once per re-creation, so the
            # k-th group of each member lands under the same prefix (no store key is ever reused).
            base = dist.PrefixStore(f"bcp/coord/{_digest(members)}/{timeout:g}/{channel}/",
                                    default_store())
            incarnation = (base.add("created", 1) - 1) // self.size
            self.store = dist.PrefixStore(f"{incarnation}/", base)
            self._meet(warn_after)
            self.backend = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", self.store), self.rank, self.size,
                                                 datetime.timedelta(seconds=timeout))
        except DistributedError:  # members missing: _meet's own error names them
            raise
        except Exception as exc:  # torch raises DistStoreError/DistNetworkError/RuntimeError here
            raise self.failed(f"setting up checkpoint coordination (channel {channel!r})", exc) from exc

    def _meet(self, warn_after: float | None) -> None:
        """Waits, up to the timeout, until every member has arrived at this group's setup (gloo's own
        rendezvous would wait silently for the store's timeout, half an hour by default), warning
        after ``warn_after`` seconds about the members that have not; raises a ``DistributedError``
        naming them at the timeout (and tells the late ones that it stopped waiting)."""
        self.store.set(f"arrived/{self.rank}", b"")
        if self.store.add("arrived", 1) == self.size:
            self.store.set("everyone", b"")
        where = (f"checkpoint coordination over ranks {ranks_text(self.members)} failed while setting up checkpoint "
                 f"coordination (channel {self.channel!r})")
        me = f"this rank (rank {self.members[self.rank]})"
        if not wait_for(store_keys_set(self.store, ["everyone"]), self.timeout, warn_after, self._warn_not_arrived,
                        store_wait(self.store, ["everyone"])):
            self.store.set("gave up", str(self.members[self.rank]))
            raise DistributedError(f"{where}: no report from rank(s) {ranks_text(self._not_arrived())} within "
                                   f"{self.timeout:g}s (it died, hung or did not call bcp: {_together(None)}); "
                                   f"{me} waited for them")
        if self.store.check(["gave up"]):
            raise DistributedError(f"{where}: rank {self.store.get('gave up').decode()} had stopped waiting for the "
                                   f"others (its timeout of {self.timeout:g}s ran out before {me} arrived: "
                                   f"{_together(None)})")

    def _not_arrived(self) -> list[int]:
        return [self.members[r] for r in range(self.size)
                if r != self.rank and not self.store.check([f"arrived/{r}"])]

    def _warn_not_arrived(self, waited: float) -> None:
        absent = self._not_arrived()
        if absent:
            _log.warning("rank %d has waited %gs to set up checkpoint coordination over ranks %s (channel %r) for "
                         "rank(s) %s, which have not called bcp: %s", self.members[self.rank], waited,
                         ranks_text(self.members), self.channel, ranks_text(absent), _together(self.timeout))

    def run(self, op: Callable[[Any], Any], warn_after: float | None = None) -> None:
        """Runs the collective ``op(backend)`` (it returns gloo's work) to completion; a failure
        releases the group and raises a ``DistributedError`` naming the members that did not report it.
        Still waiting after ``warn_after`` seconds, it logs a WARNING naming the members that have
        not reached this exchange (the exchange itself waits on, up to the group's timeout)."""
        backend = self._backend()
        self._exchanges += 1
        try:
            work = op(backend)
            if warn_after is None or not self._waited(work, min(_PRESENT_AFTER_S, warn_after)):
                work.wait()
                return
            self._say_present()
            if self._waited(work, max(0.0, warn_after - _PRESENT_AFTER_S)):
                self._warn_absent(warn_after)
            work.wait()
        except Exception as exc:  # DistBackendError/RuntimeError on timeouts and dead peers
            raise self.failed("exchanging", exc) from exc

    def _waited(self, work: Any, seconds: float) -> bool:
        """Waits up to ``seconds`` for ``work``; whether it is still running then (its failure raises)."""
        try:
            work.wait(datetime.timedelta(seconds=seconds))
            return False
        except RuntimeError:
            if work.is_completed():  # not our short wait running out: the exchange failed
                raise
            return True

    def _say_present(self) -> None:
        """Marks this member as arrived at the current exchange, for a waiting member's roll call.
        Written only by members that wait long, so quick exchanges never touch the store."""
        try:
            self.store.set(f"present/{self._exchanges}/{self.rank}", b"")
        except Exception:  # the store's host is gone: the exchange's own failure says so
            pass

    def _warn_absent(self, waited: float) -> None:
        try:
            absent = [self.members[r] for r in range(self.size)
                      if r != self.rank and not self.store.check([f"present/{self._exchanges}/{r}"])]
        except Exception:  # the store's host is gone: the exchange's own failure says so
            return
        if absent:
            _log.warning("rank %d has waited %gs in a checkpoint exchange over ranks %s (channel %r) for rank(s) %s, "
                         "which have not reached it: %s", self.members[self.rank], waited, ranks_text(self.members),
                         self.channel, ranks_text(absent), _together(self.timeout))

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Sends ``tensor`` to member ``peer`` (an index in ``members``); returns the work to wait on."""
        return self._backend().send([tensor], peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Receives into ``tensor`` from member ``peer``; returns the work to wait on."""
        return self._backend().recv([tensor], peer, tag)

    def close(self) -> None:
        """Shut the group down now: gloo's threads are joined and its sockets closed (the peers'
        pending exchanges on it fail). Idempotent."""
        self.closed = True
        backend, self.backend, self.store = self.backend, None, None
        if backend is not None and hasattr(backend, "shutdown"):
            try:
                backend.shutdown()
            except Exception:  # already broken by a failed peer: dropping the reference is all that is left
                pass

    def _backend(self) -> Any:
        if self.backend is None:
            why = ("was shut down (its process group was destroyed, or bcp.shutdown() or the process's "
                   "exit released it)" if self.closed else "already failed")
            raise DistributedError(f"checkpoint coordination over ranks {ranks_text(self.members)} "
                                   f"(channel {self.channel!r}) {why}")
        return self.backend

    def failed(self, doing: str, exc: BaseException) -> DistributedError:
        """Releases the group and builds the error: what failed, which members stayed silent."""
        self.backend = None  # the last reference: gloo closes its sockets, so the peers fail now too
        with _lock:
            for key, group in list(_live.items()):
                if group is self:
                    del _live[key]
        silent, why = self._silent_members()
        seen = _GLOO_ADVICE.sub("", _SOURCE_PREFIX.sub("", (str(exc).strip().splitlines() or [""])[0]))
        return DistributedError(
            f"checkpoint coordination over ranks {ranks_text(self.members)} failed while {doing}: "
            f"no report from rank(s) {ranks_text(silent)} {why}; "
            f"this rank (rank {self.members[self.rank]}) saw {type(exc).__name__}: {seen}"
            if silent else
            f"checkpoint coordination over ranks {ranks_text(self.members)} failed while {doing} "
            f"(every rank reported the failure); this rank (rank {self.members[self.rank]}) saw "
            f"{type(exc).__name__}: {seen}")

    def _silent_members(self) -> tuple[list[int], str]:
        """The members that did not report a failure within the grace, and why they are named."""
        grace = min(self.timeout, REPORT_GRACE_S)
        others = [r for r in range(self.size) if r != self.rank]
        unreachable = "(the store is unreachable: its host, usually rank 0 or the launcher, is gone)"
        if self.store is None:  # the failure was the store's own
            return [self.members[r] for r in others], unreachable
        try:
            self.store.set(f"failed/{self.rank}", b"")
            deadline = time.monotonic() + grace
            while others and time.monotonic() < deadline:
                others = [r for r in others if not self.store.check([f"failed/{r}"])]
                if others:
                    time.sleep(_POLL_S)
        except Exception:  # torch raises DistNetworkError when the store's host died
            return [self.members[r] for r in others], unreachable
        return [self.members[r] for r in others], f"within {grace:g}s (it died, hung or did not call bcp)"

    def _anchor(self, parent: "dist.ProcessGroup") -> None:
        if not any(ref() is parent for ref in self._parents):
            self._parents.append(weakref.ref(parent))

    def _anchored(self, live: Any) -> bool:
        """Whether a process group it was handed out for is still alive (not destroyed)."""
        self._parents = [ref for ref in self._parents if (p := ref()) is not None and p in live]
        return bool(self._parents)


def release_side_groups(every: bool = False) -> int:
    """Shut down the side groups whose process groups were all destroyed (``every``: all of them);
    returns how many. Members reach the same decision, as in :func:`side_group`."""
    live = live_groups()
    with _lock:
        released = [key for key, group in _live.items() if every or not group._anchored(live)]
        groups = [_live.pop(key) for key in released]
    for group in groups:
        group.close()
    return len(groups)


def side_group(parent: "dist.ProcessGroup", timeout: float, channel: str,
               warn_after: float | None = None) -> SideGroup:
    """The side group for ``parent``'s members on ``channel``: the one already handed out while a
    live process group holds it, else a new one (collective over the members only; still waiting
    for members after ``warn_after`` seconds, it warns naming them, and it fails at ``timeout``)."""
    live = live_groups()
    if parent == dist.GroupMember.NON_GROUP_MEMBER:  # torch's stand-in for a group this rank is not in
        raise DistributedError(f"rank {dist.get_rank()} is not a member of the coordinator's process group")
    if parent is None or parent not in live:
        raise DistributedError("checkpoint coordination needs a live process group: this one was destroyed, "
                               "or torch.distributed is not initialized")
    members = tuple(sorted(dist.get_process_group_ranks(parent)))
    if dist.get_rank() not in members:
        raise DistributedError(f"rank {dist.get_rank()} is not a member of the coordinator's process group "
                               f"(ranks {ranks_text(members)})")
    key = (members, timeout, channel)
    # Every member reaches the same decision here: it depends only on which groups were created
    # and destroyed, which members do in the same order (torch requires it for the groups themselves).
    release_side_groups()
    with _lock:
        group = _live.get(key)
        if group is not None:
            group._anchor(parent)
            return group
    group = SideGroup(members, timeout, channel, warn_after)  # outside the lock: the rendezvous waits for peers
    group._anchor(parent)
    with _lock:
        _live[key] = group
    return group


def _fresh_lock_in_child() -> None:
    # Another thread of the parent may have held the lock at the fork: it would never be released here.
    global _lock
    _lock = threading.Lock()


left_alone_in_forked_children(_live)
os.register_at_fork(after_in_child=_fresh_lock_in_child)


def _digest(members: tuple[int, ...]) -> str:
    return hashlib.sha1(",".join(map(str, members)).encode(), usedforsecurity=False).hexdigest()[:16]


def _together(timeout: float | None) -> str:
    """What to do about ranks that never arrive; ``timeout``: while still waiting for them."""
    outcome = f"waits until the timeout of {timeout:g}s and then fails" if timeout is not None else "fails this way"
    return ("every rank of the group must call bcp.save / bcp.load together (a save or load called on some ranks "
            f"only, as under `if rank == 0:`, {outcome})")
