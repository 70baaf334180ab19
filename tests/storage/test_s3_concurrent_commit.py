"""Two jobs saving the same generation of one s3:// checkpoint at the same moment."""

from __future__ import annotations

import threading

import bcp
from bcp.storage import S3Storage
from bcp.tools import open_checkpoint
from models import build, full_state, train
from s3_fault_proxy import FaultProxy


def test_two_jobs_racing_for_one_generation_each_commit_a_generation_of_their_own(s3_server, s3_url):
    # The proxy holds each job's first write into generation 2 (its claim, a conditional put) until the
    # other job's arrives, so both go for generation 2 at once: one claims it, the other the next one,
    # and neither writes into the other's generation.
    both_writing = threading.Barrier(2, timeout=10)
    held = iter(range(2))  # the first two writes into generation 2 wait; later ones go through
    lock = threading.Lock()

    def align(method: str, path: str) -> None:
        if method == "PUT" and "gen-00000002/" in path:
            with lock:
                hold = next(held, None) is not None
            if hold:
                both_writing.wait()

    proxy = FaultProxy(s3_server.endpoint, align)
    try:
        first = build("plain", seed=1)
        bcp.save(S3Storage(s3_url, **s3_server.options()), {"model": first[0], "optimizer": first[1]})
        jobs = {seed: build("plain", seed=seed) for seed in (2, 3)}
        for model, optimizer in jobs.values():
            train(model, optimizer, range(1))
        outcomes: dict[int, BaseException | None] = {}

        def job(seed: int, url: str) -> None:
            # Each job spells the URL its own way: one process's saves to one spelling are numbered
            # apart by design, two jobs (two processes) are not, and that is the case under test.
            model, optimizer = jobs[seed]
            try:
                bcp.save(S3Storage(url, **s3_server.options(proxy.endpoint)),
                         {"model": model, "optimizer": optimizer})
                outcomes[seed] = None
            except BaseException as exc:  # noqa: BLE001 (the job's outcome, whatever it is, is the result)
                outcomes[seed] = exc

        threads = [threading.Thread(target=job, args=(2, s3_url)), threading.Thread(target=job, args=(3, s3_url.replace("s3://ckpt/", "s3://ckpt//")))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        proxy.close()
    assert all(error is None for error in outcomes.values()), outcomes
    checkpoint = open_checkpoint(S3Storage(s3_url, **s3_server.options()))
    assert [g for g, committed in checkpoint.generations() if committed] == [2, 3]
    expected = {seed: full_state(*jobs[seed]) for seed in jobs}
    saved_by = set()
    for generation in (2, 3):
        ckpt = open_checkpoint(S3Storage(s3_url, **s3_server.options()), generation=generation)
        model = {name: ckpt.read(name) for name in ckpt.tensors if name.startswith("model/")}
        owners = [seed for seed, state in expected.items() if all(state[k].equal(v) for k, v in model.items())]
        assert len(owners) == 1, f"generation {generation} holds a mix of both jobs' tensors"
        saved_by.add(owners[0])
    assert saved_by == {2, 3}
