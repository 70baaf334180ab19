"""64 gRPC coordinator nodes on loopback (threads of this process) plan a Llama-405B-shaped save
(TP8 x PP4 x DP2, the benchmark's synthetic local plans): every node gets the plan that planning
all local plans in one place gives, and the exchanges travel the tree as configured."""

from __future__ import annotations

import os
import sys

from grpc_nodes import close_all, on_threads, start_nodes

from bcp.coord.consensus import Outcome, all_agree, gather_then_reply
from bcp.layout.local_plan import LocalPlan
from bcp.planning.save_plan import PlanColumns, global_plan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from planning_scale import local_plan  # noqa: E402  (the benchmark's Llama-405B-shaped plans)

TP, PP, DP = 8, 4, 2
WORLD = TP * PP * DP


def plan_of(rank: int) -> list:
    """Rank ``rank``'s local plan as it travels (plain data)."""
    return local_plan(rank % TP, TP, (rank // TP) % PP, PP, rank // (TP * PP), DP).to_wire()


def planned(wires: list) -> list:
    return [share.to_wire() for share in global_plan(PlanColumns([LocalPlan.from_wire(w) for w in wires]))]


def test_64_nodes_plan_a_llama_405b_shaped_save_through_a_tree_of_the_configured_shape():
    plans = [plan_of(r) for r in range(WORLD)]
    expected = planned(plans)
    nodes = start_nodes(WORLD, "llama", timeout=120, ranks_per_machine=8, fan_out=2)
    try:
        def plan_on(rank: int) -> list:
            node = nodes[rank]
            mine = gather_then_reply(node, Outcome(plans[rank]), planned,
                                     "planning")
            agreed = all_agree(node, Outcome(len(mine["whole"]) + len(mine["parts"])), "agreeing")
            return [mine, agreed]

        results = on_threads(WORLD, plan_on)
    finally:
        close_all(nodes)
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), f"rank {rank}: {result!r}"
        assert result[0] == expected[rank]
        assert result[1] == [len(share["whole"]) + len(share["parts"]) for share in expected]

    tree = nodes[0].tree
    # 8 machines of 8 ranks; their leaders in a binary tree 3 levels deep; local ranks one below.
    assert max(tree.depth(r) for r in range(WORLD)) == 4
    assert tree.children(0) == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    exchanges = 3  # gather + scatter (planning), all_gather (agreeing)
    for rank, node in enumerate(nodes):
        children = tree.children(rank)
        assert len(children) == (7 if rank % 8 == 0 else 0) + len([c for c in children if c % 8 == 0])
        assert len([c for c in children if c % 8 == 0]) <= 2
        # One call per child per exchange, and in each gather exactly the parts of the ranks below.
        assert node.received.calls == len(children) * exchanges
        assert node.received.parts == 2 * (len(tree.subtree(rank)) - 1)
