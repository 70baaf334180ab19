"""The coordinator over gRPC (paper section 5.2): exchanges travel a tree of ranks (``topology``),
each child making one call to its parent per exchange that carries its subtree's contributions up
and, as the reply, its subtree's share of the result down. The root so handles O(fan-out) calls, and
each node's work is linear in what it receives. Channels live as long as the coordinator.

Every exchange has a deadline. A node waits for its children until a share of the timeout that grows
with its height in the tree, then reports the missing ones up; the root's verdict travels down, so a
dead or hung rank is named, with its machine and the exchange, on every surviving rank before the
timeout ends. After a failure the coordinator refuses further exchanges: ranks are out of step.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import grpc

from bcp.coord.grpc import tree_pb2, tree_pb2_grpc
from bcp.coord.grpc.inbox import Inbox, Received, TreeServicer
from bcp.coord.grpc.rendezvous import Peer, look_up, meet, publish, share_secret
from bcp.coord.grpc.security import SecretCheck, TlsConfig, secret_metadata
from bcp.coord.forked_children import left_alone_in_forked_children
from bcp.coord.grpc.topology import Tree
from bcp.coord.waiting import ranks_text, timeout_from_env, warn_after_from_env
from bcp.errors import DistributedError

DEFAULT_TIMEOUT_S = 600.0  # as the torch.distributed coordinator's default
DEFAULT_FAN_OUT = 8
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
CLOSE_GRACE_S = 5.0  # one message carries a subtree's plans: room for thousands of ranks
_OP_NAMES = {tree_pb2.ALL_GATHER: "all_gather", tree_pb2.GATHER: "gather", tree_pb2.SCATTER: "scatter",
             tree_pb2.BROADCAST: "broadcast"}
_TOGETHER = ("every rank must call bcp.save / bcp.load together (a save or load called on some ranks only, as "
             "under `if rank == 0:`, waits until the timeout of {timeout:g}s and then fails)")
log = logging.getLogger("bcp.coord")
_made: dict[str, itertools.count] = {}  # coordinators this process made per channel: their store namespace
_open: "weakref.WeakSet[GrpcCoordinator]" = weakref.WeakSet()


class GrpcCoordinator:
    """Exchanges bytes between ranks over gRPC; every rank constructs it (collectively).

    Ranks meet through ``store`` (default: the process group's, else ``MASTER_ADDR``/``MASTER_PORT``
    with ``RANK``/``WORLD_SIZE``). Machines are runs of ``ranks_per_machine`` ranks (default:
    ``LOCAL_WORLD_SIZE``, else 1); their leaders form a tree of ``fan_out`` children each. Servers
    listen on ``host`` (default: the local address on the route to the store, loopback for a local
    store), never on every interface unless told. ``timeout`` (seconds; default ``BCP_TIMEOUT_S``,
    else 600) bounds every wait for the other ranks, the setup included; ``warn_after`` (seconds;
    default ``BCP_WARN_AFTER_S`` or 30; 0: never) is how long a rank waits before it logs a WARNING
    naming the ranks it waits for. ``address`` is where this rank's server listens ("" on a rank
    without children, which runs none).
    """

    def __init__(self, *, store: Any = None, rank: int | None = None, world_size: int | None = None,
                 timeout: float | None = None, fan_out: int = DEFAULT_FAN_OUT,
                 ranks_per_machine: int | None = None, host: str | None = None, tls: TlsConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, channel: str = "plan",
                 namespace: str | None = None, warn_after: float | None = None) -> None:
        timeout = timeout_from_env(DEFAULT_TIMEOUT_S) if timeout is None else timeout
        self.warn_after = warn_after_from_env() if warn_after is None else (warn_after or None)
        meeting = meet(store, rank, world_size, host, timeout)
        self.rank, self.world_size, self.timeout = meeting.rank, meeting.world_size, timeout
        self.channel = channel
        self.namespace = namespace or f"{channel}/{next(_made.setdefault(channel, itertools.count()))}"
        self.tree = Tree.build(self.world_size, ranks_per_machine or int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                               fan_out)
        self._settings = dict(store=meeting.store, rank=self.rank, world_size=self.world_size, timeout=timeout,
                              fan_out=fan_out, ranks_per_machine=ranks_per_machine, host=meeting.bind_host,
                              tls=tls, max_message_bytes=max_message_bytes, warn_after=self.warn_after or 0)
        scoped = meeting.scoped(self.namespace)
        with _setting_up(channel):  # the waits for the other ranks
            self._metadata = secret_metadata(share_secret(scoped, self.rank, timeout, self.warn_after))
        self._exchanges = itertools.count()
        self._failures: list[tree_pb2.Failure] = []
        self._sibling: GrpcCoordinator | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._inbox = Inbox(self.tree, self.rank)
        self._route = {r: c for c, ranks in self._inbox.subtrees.items() for r in ranks}
        # The share of the timeout this node waits for its children: the root waits longest, and
        # every level below answers (or reports who is missing) before the level above gives up.
        self._wait_s = timeout * self.tree.height(self.rank) / (self.tree.height(0) + 1)
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        self._server, self.address = (self._serve(meeting.bind_host, options, tls) if self._inbox.children
                                      else (None, ""))
        publish(scoped, self.rank, Peer(socket.gethostname(), self.address))
        parent = self.tree.parents[self.rank]
        with _setting_up(channel):
            self._peers = look_up(scoped, self.rank, self._inbox.children + ([parent] if parent >= 0 else []),
                                  timeout, self.warn_after)
        self._channel = self._stub = None
        if parent >= 0:
            self._channel = _open_channel(self._peers[parent].address, options, tls)
            self._stub = tree_pb2_grpc.TreeStub(self._channel)
        _open.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def received(self) -> Received:
        """Calls and parts this rank's server accepted from its children so far."""
        return self._inbox.received

    def sibling(self) -> "GrpcCoordinator":
        """The same ranks on a tree of their own (made on the first call, reused after)."""
        if self._sibling is None:
            self._sibling = GrpcCoordinator(**self._settings, channel=f"{self.channel}/background",
                                            namespace=f"{self.namespace}/background")
        return self._sibling

    def cache_key(self) -> object:
        return ("grpc", self.namespace, self.rank, self.world_size)


    def process_group(self) -> None:
        """No torch.distributed group: ``load(read_once=True)`` reads without sharing."""
        return None
    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        down = self._exchange(tree_pb2.ALL_GATHER, data, _in_rank_order)
        return [p.data for p in down]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        kept: list[bytes] = []
        self._exchange(tree_pb2.GATHER, data, lambda parts: kept.extend(p.data for p in _in_rank_order(parts)))
        return kept if self.rank == 0 else None

    def scatter_bytes(self, parts: list[bytes] | None) -> bytes:
        if self.rank == 0 and (parts is None or len(parts) != self.world_size):
            raise ValueError(f"scatter_bytes needs one message per rank ({self.world_size}) on rank 0")
        down = self._exchange(tree_pb2.SCATTER, None, lambda _: [tree_pb2.Part(rank=r, data=d)
                                                                for r, d in enumerate(parts)])
        return next(p.data for p in down if p.rank == self.rank)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        if self.rank == 0 and data is None:
            raise ValueError("broadcast_bytes needs the bytes on rank 0")
        return self._exchange(tree_pb2.BROADCAST, None, lambda _: [tree_pb2.Part(rank=0, data=data)])[0].data

    def close(self) -> None:
        """Stops this rank's server and closes its channel (and its sibling's); idempotent."""
        with self._lock:
            self._closed = True
            self._failures = self._failures or [tree_pb2.Failure(rank=self.rank, message="closed")]
            self._inbox.fail(self._failures)
            if self._server is not None:
                # Calls still in flight hold replies (the last exchange's, or the failure just set):
                # let them go out before the connections close.
                self._server.stop(grace=CLOSE_GRACE_S).wait()
                self._server = None
            if self._channel is not None:
                self._channel.close()
                self._channel = None
        if self._sibling is not None:
            self._sibling.close()
        _open.discard(self)

    def __enter__(self) -> "GrpcCoordinator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _exchange(self, op: int, mine: bytes | None,
                  decide: Callable[[list[tree_pb2.Part]], list[tree_pb2.Part] | None]) -> list[tree_pb2.Part]:
        """One exchange: the subtree's parts go up (``mine`` in gathers); the root turns every part
        into the parts that come down (``decide``); this rank gets its share of those."""
        if self._failures:
            raise self._error("a new exchange", self._failures, "an earlier exchange failed")
        exchange = next(self._exchanges)
        phase = f"exchange {exchange} ({_OP_NAMES[op]})"
        start = time.monotonic()
        parts = [tree_pb2.Part(rank=self.rank, data=mine)] if mine is not None else []
        failures = self._collect(exchange, op, phase, start, parts) if self._inbox.children else []
        if self._stub is not None:
            up = tree_pb2.Up(exchange=exchange, op=op, sender=self.rank, parts=[] if failures else parts,
                             failures=failures)
            down = self._ask_parent(up, phase, start)
            if not down.failures and not self._complete(op, down):
                down = tree_pb2.Down(exchange=exchange, failures=[self._failure(
                    self.tree.parents[self.rank], phase, "replied without this rank's share")])
        elif failures:
            down = tree_pb2.Down(exchange=exchange, failures=failures)
        else:
            down = tree_pb2.Down(exchange=exchange, parts=decide(parts) or [])
        if self._inbox.children:
            self._inbox.reply(exchange, self._replies(op, down))
        if down.failures:
            self._failures = list(down.failures)
            self._inbox.fail(self._failures)
            raise self._error(phase, self._failures)
        return list(down.parts)

    def _collect(self, exchange: int, op: int, phase: str, start: float,
                 parts: list[tree_pb2.Part]) -> list[tree_pb2.Failure]:
        """Adds the children's parts to ``parts``; returns the failures seen in this subtree."""
        deadline = start + self._wait_s
        if self.warn_after is not None and self.warn_after < self._wait_s:
            ups = self._inbox.collect(exchange, start + self.warn_after)
            if len(ups) < len(self._inbox.children):
                self._warn_children_missing(phase, [c for c in self._inbox.children if c not in ups])
        ups = self._inbox.collect(exchange, deadline)
        failures = []
        for child in self._inbox.children:
            up = ups.get(child)
            if up is None:
                failures.append(self._failure(child, phase, f"sent nothing within {self._wait_s:.1f}s "
                                                            "(dead, hung, or not calling bcp)"))
            elif up.op != op:
                failures.append(self._failure(child, phase, f"called {_OP_NAMES.get(up.op, up.op)} "
                                                            f"while rank {self.rank} called {_OP_NAMES[op]}"))
            else:
                parts.extend(up.parts)
                failures.extend(up.failures)
        return failures

    def _ask_parent(self, up: tree_pb2.Up, phase: str, start: float) -> tree_pb2.Down:
        parent = self.tree.parents[self.rank]
        call = self._stub.Exchange.future(up, timeout=max(0.0, start + self.timeout - time.monotonic()),
                                          metadata=self._metadata)
        try:
            # A node that waited long for its children has said so already: only a quick one warns here.
            warn_in = None if self.warn_after is None else self.warn_after - (time.monotonic() - start)
            if warn_in is not None and warn_in > 0:
                try:
                    return call.result(timeout=warn_in)
                except grpc.FutureTimeoutError:
                    log.warning("rank %d has waited %gs in %s of the gRPC checkpoint coordinator for the answer of "
                                "rank %d, its parent in the tree: rank %d, or a rank it waits for (which it names), "
                                "has not reached it: %s", self.rank, self.warn_after, phase, parent, parent,
                                _TOGETHER.format(timeout=self.timeout))
            return call.result()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                why = f"did not answer within {self.timeout:.1f}s (it, or a rank above it, is hung)"
            else:
                why = f"could not be reached ({exc.code().name}: {exc.details()})"
            return tree_pb2.Down(exchange=up.exchange, failures=[self._failure(parent, phase, why)])

    def _complete(self, op: int, down: tree_pb2.Down) -> bool:
        """Whether a reply holds what this rank takes from it."""
        if op == tree_pb2.ALL_GATHER:
            return len(down.parts) == self.world_size
        if op == tree_pb2.SCATTER:
            return any(p.rank == self.rank for p in down.parts)
        return len(down.parts) == (1 if op == tree_pb2.BROADCAST else 0)

    def _replies(self, op: int, down: tree_pb2.Down) -> dict[int, tree_pb2.Down]:
        """Each child's share of ``down``: in a scatter, the parts of its subtree; else all of it."""
        if op != tree_pb2.SCATTER or down.failures:
            return dict.fromkeys(self._inbox.children, down)
        shares: dict[int, list[tree_pb2.Part]] = {c: [] for c in self._inbox.children}
        for part in down.parts:
            if part.rank != self.rank:
                shares[self._route[part.rank]].append(part)
        return {c: tree_pb2.Down(exchange=down.exchange, parts=p) for c, p in shares.items()}

    def _warn_children_missing(self, phase: str, children: list[int]) -> None:
        below = sorted(r for c in children for r in self._inbox.subtrees[c] if r not in children)
        log.warning("rank %d has waited %gs in %s of the gRPC checkpoint coordinator for rank(s) %s, which have not "
                    "reached it%s: %s", self.rank, self.warn_after, phase, ranks_text(children),
                    f" (or wait for ranks below them in the tree: rank(s) {ranks_text(below)})" if below else "",
                    _TOGETHER.format(timeout=self.timeout))

    def _failure(self, rank: int, phase: str, message: str) -> tree_pb2.Failure:
        return tree_pb2.Failure(rank=rank, host=self._peers[rank].describe(), phase=phase, message=message)

    def _error(self, phase: str, failures: list[tree_pb2.Failure], prefix: str = "") -> DistributedError:
        detail = "; ".join(f"rank {f.rank} on {f.host or 'an unknown host'}: {f.message}"
                           + (f" in {f.phase}" if f.phase and f.phase != phase else "") for f in failures)
        return DistributedError(f"checkpoint coordination over gRPC failed in {phase} on rank {self.rank}"
                                f"{': ' + prefix if prefix else ''}: {detail}")

    def _serve(self, host: str, options: list[tuple[str, int]], tls: TlsConfig | None) -> tuple[grpc.Server, str]:
        """This rank's server for its children, started, and the address it listens on."""
        server = grpc.server(ThreadPoolExecutor(max_workers=len(self._inbox.children) + 4,
                                                thread_name_prefix=f"bcp-grpc-{self.rank}"),
                             interceptors=[SecretCheck(self._metadata[0][1], self.rank)],
                             options=options + [("grpc.so_reuseport", 0)])
        tree_pb2_grpc.add_TreeServicer_to_server(TreeServicer(self._inbox), server)
        where = _address(host, 0)
        try:
            port = server.add_secure_port(where, tls.server_credentials()) if tls else server.add_insecure_port(where)
        except RuntimeError as exc:
            raise DistributedError(f"the gRPC coordinator cannot listen on {where}: {exc}") from exc
        server.start()
        return server, _address(host, port)


@contextmanager
def _setting_up(channel: str) -> Iterator[None]:
    """Names the phase in a failure to meet the other ranks, as the torch.distributed coordinator does."""
    try:
        yield
    except DistributedError as exc:
        raise DistributedError(f"setting up checkpoint coordination (channel {channel!r}) over gRPC failed: "
                               f"{exc}") from exc


def _open_channel(address: str, options: list[tuple[str, Any]], tls: TlsConfig | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options + tls.channel_options())


def _in_rank_order(parts: list[tree_pb2.Part]) -> list[tree_pb2.Part]:
    ordered: list[tree_pb2.Part | None] = [None] * len(parts)
    for part in parts:
        ordered[part.rank] = part
    return ordered


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


left_alone_in_forked_children(_open)


def close_open_coordinators() -> None:
    """Close every gRPC coordinator of this process still open (``bcp.shutdown()`` and exit)."""
    for coordinator in list(_open):
        coordinator.close()
