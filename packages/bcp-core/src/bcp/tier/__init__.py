"""The memory tier: checkpoints in node-local memory, replicated to peer nodes, recovered without
storage into the same or a smaller layout, persisted every k-th save (``docs/memory-tier.md``).

One module per concept: ``placement`` (nodes, who keeps whose copies), ``local`` (a node's folder,
generations), ``transfer`` (file bytes between ranks), ``replication``, ``commit`` (agree, then mark),
``persistence``, ``recovery`` (which generation the live ranks can load), ``overlay`` and
``peer_source`` (reading it through peers), ``memory_tier`` (the public object)."""

from bcp.tier.memory_tier import MemoryTier

__all__ = ["MemoryTier"]
