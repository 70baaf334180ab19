"""A load that fails because a peer died (SIGKILL at a chosen exchange of a 2-rank load) or hung
(it stops answering until the coordinator's timeout) leaves the survivor's model and optimizer as
they were: a never-stepped AdamW keeps no state, a trained one its own. Ranks are processes of the
test's own (the shared rank pool cannot lose a rank), as in ``test_peer_death.py``."""

from __future__ import annotations

import copy
import datetime
import multiprocessing as mp
import queue
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import bcp
from dying_coordinator import Dying, die, reap
from optimizer_cases import differences
from test_peer_death import free_port

pytestmark = pytest.mark.distributed  # processes of its own, outside the rank pool

TIMEOUT_S = 3.0  # the process group's timeout, hence the coordinator's
CASE_LIMIT_S = 120  # the survivor has hung if it has not answered by then
# A 2-rank load's exchanges: the manifest sent from rank 0 (1), the agreement that every rank read
# and verified its bytes (2); only after that does any rank place a byte or touch an optimizer.
EXCHANGES = {"opening": 1, "reading": 2}


class Hanging(Dying):
    """The real coordinator, except that it stops answering at its ``die_at``-th exchange for
    longer than the coordinator's timeout (a hung rank), then dies."""

    def _exchange(self, method: str, message):
        self.exchanges += 1
        if self.exchanges == self.die_at:
            time.sleep(2 * TIMEOUT_S)  # the survivor's wait ends first, with its error
            die()
        return getattr(self.inner, method)(message)


def model_and_optimizer(trained: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1 if trained else 2)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    if trained:
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    return model, optimizer


def rank_main(rank: int, port: int, path: str, victim: int, how: str, exchange: int, trained: bool,
              answers: "mp.Queue") -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    saved_model, saved_optimizer = model_and_optimizer(trained=True)
    bcp.save(path, {"model": saved_model, "optimizer": saved_optimizer})
    model, optimizer = model_and_optimizer(trained)
    before = {"model": {k: v.clone() for k, v in model.state_dict().items()},
              "optimizer": copy.deepcopy(optimizer.state_dict())}
    bcp.TorchCoordinator()  # set up before the victim may die: the load's exchanges alone are under test
    store.set(f"ready/{rank}", b"")
    store.wait(["ready/0", "ready/1"])
    state = {"model": model, "optimizer": optimizer}
    if rank == victim:
        wrapper = Dying if how == "dies" else Hanging
        bcp.load(path, state, coordinator=wrapper(bcp.TorchCoordinator(), exchange))
        answers.put(("victim survived", ""))
        return
    try:
        bcp.load(path, state)
        answers.put(("loaded", ""))
    except bcp.CheckpointError as exc:
        changed = differences(before["optimizer"], optimizer.state_dict()) + [
            f"model/{k}" for k, v in model.state_dict().items() if not torch.equal(v, before["model"][k])]
        answers.put((type(exc).__name__, "; ".join(changed)))


def run_case(path: str, victim: int, how: str, exchange: int, trained: bool) -> tuple[tuple, list]:
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, path, victim, how, exchange, trained, answers),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        answer = answers.get(timeout=CASE_LIMIT_S)
    except queue.Empty:
        answer = ("no answer: the survivor hung", "")
    return answer, reap(procs)


CASES = [("dies", "opening", False), ("dies", "reading", False), ("dies", "reading", True), ("hangs", "reading", False)]


@pytest.mark.parametrize("how,phase,trained", CASES,
                         ids=[f"{h}-{p}-{'trained' if t else 'fresh'}" for h, p, t in CASES])
def test_a_load_failed_by_a_dead_or_hung_peer_leaves_the_model_and_optimizer_as_they_were(
        memory_dir, how, phase, trained):
    victim = 1
    (kind, changed), codes = run_case(f"{memory_dir}/ckpt", victim, how, EXCHANGES[phase], trained)
    assert codes[victim] == -signal.SIGKILL, f"the victim did not die as planned: {codes}, {kind}"
    assert codes[1 - victim] == 0, f"the survivor did not exit cleanly: {codes}"
    assert kind == "DistributedError", kind
    assert changed == "", f"the failed load changed {changed}"
