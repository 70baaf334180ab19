"""Which node each rank is on, and which nodes keep the copies of a node's files.

Nodes are named by the caller (``MemoryTier(nodes=...)``, one id per rank), else by ``BCP_NODE``,
else by host name: ranks that share a name share a node-local folder. A node's files are copied to
the ``replicas`` nodes after it in the order of their first rank (wrapping around), so a file and
its copy never share a node, and each node keeps the copies of as many nodes as it sends to."""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Sequence

from bcp.errors import CheckpointError

NODE_ENV = "BCP_NODE"
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

logger = logging.getLogger("bcp")
_warned: set[tuple[int, int]] = set()  # (replicas asked, nodes): said once per process


def node_of(rank: int, world_size: int, nodes: Sequence[str] | None) -> str:
    """This rank's node id: ``nodes[rank]``, else ``BCP_NODE``, else the host name (see
    :func:`split_shared_hosts` for several launcher nodes on one host)."""
    if nodes is not None:
        if len(nodes) != world_size:
            raise CheckpointError(f"MemoryTier(nodes=...) names {len(nodes)} node(s), one per rank is needed "
                                  f"({world_size} ranks)")
        node = nodes[rank]
    else:
        node = os.environ.get(NODE_ENV) or socket.gethostname()
    if not isinstance(node, str) or not _NODE_ID.fullmatch(node):
        raise CheckpointError(f"invalid node id {node!r}: use letters, digits, '_', '-' and '.'")
    return node


def launcher_node() -> str | None:
    """The launcher's node rank of this process (torchrun's ``GROUP_RANK``), if it set one."""
    return os.environ.get("GROUP_RANK")


def split_shared_hosts(found: Sequence[tuple[str, str | None]]) -> list[str]:
    """Every rank's node id from its (id, launcher node rank): ranks that share an id but were
    started as different launcher nodes (``torchrun --nnodes 2`` on one host) are different nodes."""
    launcher_nodes: dict[str, set] = {}
    for node, group in found:
        launcher_nodes.setdefault(node, set()).add(group)
    return [f"{node}-{group}" if len(launcher_nodes[node]) > 1 else node for node, group in found]


@dataclass(frozen=True, slots=True)
class Placement:
    """Every rank's node and who receives each rank's files."""

    #: Node id of each rank.
    nodes: tuple[str, ...]
    #: Peer copies per file actually kept (``replicas`` capped at the number of other nodes).
    replicas: int

    @staticmethod
    def of(nodes: Sequence[str], replicas: int) -> "Placement":
        distinct = len(set(nodes))
        kept = min(replicas, distinct - 1)
        if kept < replicas and (replicas, distinct) not in _warned:
            _warned.add((replicas, distinct))
            logger.warning("bcp: the memory tier asks for %d peer cop%s of each file but the job has %d node(s): "
                           "%d kept (a lost node loses the files no other node copied)", replicas,
                           "y" if replicas == 1 else "ies", distinct, kept)
        return Placement(tuple(nodes), kept)

    def node_order(self) -> list[str]:
        """Nodes in the order of their first rank."""
        return list(dict.fromkeys(self.nodes))

    def ranks_of(self, node: str) -> list[int]:
        return [rank for rank, n in enumerate(self.nodes) if n == node]

    def is_node_lead(self, rank: int) -> bool:
        """The node's lowest rank: it claims, commits and retires generations in the node's folder."""
        return self.ranks_of(self.nodes[rank])[0] == rank

    def receivers(self, rank: int) -> list[int]:
        """The ranks that write copies of ``rank``'s files: on each of the next ``replicas`` nodes,
        the rank at the same position among its node's ranks (wrapping around a smaller node)."""
        order = self.node_order()
        home = order.index(self.nodes[rank])
        position = self.ranks_of(self.nodes[rank]).index(rank)
        found = []
        for step in range(1, self.replicas + 1):
            peers = self.ranks_of(order[(home + step) % len(order)])
            found.append(peers[position % len(peers)])
        return found

    def senders(self, rank: int) -> list[int]:
        """The ranks whose files ``rank`` writes copies of, in rank order."""
        return [sender for sender in range(len(self.nodes)) if rank in self.receivers(sender)]
