"""A node's server side: its children's contributions to each exchange, held until the node has its
reply for them. A child's call blocks in its server thread until then, so one call per child per
exchange carries both directions. Calls that do not fit the tree (a stranger rank, parts of ranks
outside the sender's subtree, a repeated contribution) are refused before they are kept."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import grpc

from bcp.coord.grpc import tree_pb2
from bcp.coord.grpc.topology import Tree

log = logging.getLogger("bcp.coord")

GATHERS = (tree_pb2.ALL_GATHER, tree_pb2.GATHER)


@dataclass
class _Round:
    ups: dict[int, tree_pb2.Up] = field(default_factory=dict)
    replies: dict[int, tree_pb2.Down] | None = None


@dataclass
class Received:
    """What this node's server accepted, for tests and benchmarks: calls and parts."""

    calls: int = 0
    parts: int = 0


class Inbox:
    def __init__(self, tree: Tree, rank: int) -> None:
        self.rank = rank
        self.children = tree.children(rank)
        self.subtrees = {c: tree.subtree(c) for c in self.children}
        self.received = Received()
        self._cond = threading.Condition()
        self._rounds: dict[int, _Round] = {}
        self._replied = -1  # the last exchange answered
        self._failures: list[tree_pb2.Failure] = []  # once set, every call is answered with them

    def problem_with(self, up: tree_pb2.Up) -> str | None:
        """Why ``up`` cannot be a contribution of this node's child, or None."""
        if up.op not in (tree_pb2.ALL_GATHER, tree_pb2.GATHER, tree_pb2.SCATTER, tree_pb2.BROADCAST):
            return f"unknown operation {up.op}"
        if up.sender not in self.subtrees:
            return f"rank {up.sender} is not a child of rank {self.rank}"
        # A subtree that failed sends its failures without parts.
        expected = self.subtrees[up.sender] if up.op in GATHERS and not up.failures else []
        if sorted(p.rank for p in up.parts) != expected:
            return f"the parts are not those of rank {up.sender}'s subtree"
        return None

    def deliver(self, up: tree_pb2.Up, wait_s: float) -> tree_pb2.Down | None:
        """Keep a child's contribution; return its reply once the node has it, its failures, or
        None when ``wait_s`` passed first."""
        with self._cond:
            if self._failures or up.exchange <= self._replied:
                return tree_pb2.Down(exchange=up.exchange, failures=self._failures or [self._late(up)])
            slot = self._rounds.setdefault(up.exchange, _Round())
            if up.sender in slot.ups:
                raise ValueError(f"rank {up.sender} contributed twice to exchange {up.exchange}")
            slot.ups[up.sender] = up
            self.received.calls += 1
            self.received.parts += len(up.parts)
            self._cond.notify_all()
            self._cond.wait_for(lambda: slot.replies is not None or bool(self._failures), timeout=wait_s)
            if slot.replies is not None:  # even if the node failed or closed since: this exchange is done
                return slot.replies[up.sender]
            return tree_pb2.Down(exchange=up.exchange, failures=self._failures) if self._failures else None

    def collect(self, exchange: int, deadline: float) -> dict[int, tree_pb2.Up]:
        """The children's contributions to ``exchange`` that arrived before ``deadline`` (monotonic)."""
        with self._cond:
            slot = self._rounds.setdefault(exchange, _Round())
            self._cond.wait_for(lambda: len(slot.ups) == len(self.children),
                                timeout=max(0.0, deadline - time.monotonic()))
            return dict(slot.ups)

    def reply(self, exchange: int, replies: dict[int, tree_pb2.Down]) -> None:
        with self._cond:
            self._rounds.setdefault(exchange, _Round()).replies = replies
            self._replied = exchange
            for done in [n for n in self._rounds if n < exchange]:
                del self._rounds[done]
            self._cond.notify_all()

    def fail(self, failures: list[tree_pb2.Failure]) -> None:
        """From now on, answer every call with ``failures``: this node's exchanges are over."""
        with self._cond:
            self._failures = list(failures)
            self._cond.notify_all()

    def _late(self, up: tree_pb2.Up) -> tree_pb2.Failure:
        return tree_pb2.Failure(rank=up.sender, phase=f"exchange {up.exchange}",
                                message=f"arrived at rank {self.rank} after the exchange was over")


class TreeServicer:
    """The gRPC face of an :class:`Inbox` (``tree_pb2_grpc.TreeServicer``'s one method)."""

    def __init__(self, inbox: Inbox) -> None:
        self._inbox = inbox

    def Exchange(self, request: tree_pb2.Up, context: grpc.ServicerContext) -> tree_pb2.Down:
        remaining = context.time_remaining()
        problem = self._inbox.problem_with(request) if remaining is not None else "the call has no deadline"
        if problem is None:
            try:
                reply = self._inbox.deliver(request, wait_s=remaining)
            except ValueError as exc:
                problem = str(exc)
            else:
                if reply is None:  # this node is stuck: the caller names it
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"rank {self._inbox.rank} has no reply yet")
                return reply
        log.warning("bcp coordinator (rank %d) refused a malformed call from %s: %s",
                    self._inbox.rank, context.peer(), problem)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
