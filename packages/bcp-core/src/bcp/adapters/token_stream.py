"""A reference resumable loader for token streams that implements :class:`ShardedDataloader`.

The data is cut into ``streams`` (fixed when training first starts): stream ``s`` owns document
``i`` of every source where ``i % streams == s``, and is read by one read worker that draws a
source by the sampling ratios, appends the document to its token buffer and emits packed
sequences of ``seq_len`` tokens. A step takes one sequence from every stream, so the global batch
(``streams`` sequences) and what each stream has consumed after ``n`` steps do not depend on the
DP size: stream ``s`` is read by DP rank ``s % dp_size``. Each stream's state (per-source offsets,
draws, buffered tokens) is one sharded part; the sources, ratios and stream count are replicated.
Deterministic: the source choice of draw ``n`` is a pure function of ``(seed, stream, n)``.

Each stream is read by a read worker thread (:mod:`bcp.adapters.read_worker`) one step ahead of the
trainer. Collecting the state is a round trip to every worker, unless the loader was told the
checkpoint interval (``plan_checkpoints``): then the workers build the state of a checkpoint step
while the trainer is still on the step before, and it arrives with that step's batch.
"""

from __future__ import annotations

import random
import weakref
from typing import Any, Mapping, Sequence

import torch

from bcp.adapters.read_worker import ReadWorker
from bcp.errors import MismatchError


class _StreamReader:
    """One stream: its position in every source, the sequences it has emitted and the tokens read
    but not yet emitted."""

    def __init__(self, stream: int, loader: "TokenStreamLoader", offsets: dict[str, int], draws: int,
                 emitted: int, buffer: list[int]) -> None:
        self.stream, self.offsets, self.draws, self.emitted, self.buffer = stream, offsets, draws, emitted, buffer
        self.sources, self.ratios = loader.sources, loader.ratios
        self.seq_len, self.streams, self.seed = loader.seq_len, loader.streams, loader.seed
        self._before: tuple[dict[str, int], int, int] = (dict(offsets), draws, len(buffer))

    def next_item(self) -> list[int]:
        """The next packed sequence of ``seq_len`` tokens."""
        self._before = (dict(self.offsets), self.draws, len(self.buffer))
        names = list(self.ratios)
        while len(self.buffer) < self.seq_len:
            chooser = random.Random(f"{self.seed}:{self.stream}:{self.draws}")
            name = chooser.choices(names, weights=[self.ratios[n] for n in names])[0]
            documents = self.sources[name]
            share = range(self.stream, len(documents), self.streams)  # this stream's documents, read in epochs
            self.buffer.extend(documents[share[self.offsets[name] % len(share)]])
            self.offsets[name] += 1
            self.draws += 1
        sequence, self.buffer = self.buffer[:self.seq_len], self.buffer[self.seq_len:]
        self.emitted += 1
        return sequence

    def state(self) -> dict[str, Any]:
        return self._state(self.offsets, self.draws, self.emitted, self.buffer)

    def state_before_last(self, sequence: list[int]) -> dict[str, Any]:
        """The state before ``sequence`` (the last one emitted) was read: the documents drawn for it
        were appended to the old buffer, so the old buffer is the first tokens of sequence + buffer."""
        offsets, draws, kept = self._before
        return self._state(offsets, draws, self.emitted - 1, (sequence + self.buffer)[:kept])

    def _state(self, offsets: dict[str, int], draws: int, emitted: int, buffer: list[int]) -> dict[str, Any]:
        return {"stream": self.stream, "offsets": dict(offsets), "draws": draws, "emitted": emitted,
                "buffer": torch.tensor(buffer, dtype=torch.int64)}


class TokenStreamLoader:
    """Packed token sequences from several sources mixed by sampling ratios, for one DP rank.

    ``sources``: name -> documents (token id lists); ``ratios``: name -> sampling weight;
    ``streams``: read workers over the whole job (a fresh start deals stream ``s`` to DP rank
    ``s % dp_size``; after a load, the rank reads the streams it was given). ``next_batch()`` returns
    one sequence per stream this rank reads, in stream order. ``state_round_trips`` counts the
    collections of the state that had to ask the workers (none where every one was prefetched).
    """

    def __init__(self, sources: Mapping[str, Sequence[Sequence[int]]], ratios: Mapping[str, float], *,
                 seq_len: int, streams: int, dp_rank: int, dp_size: int, seed: int = 0) -> None:
        if set(ratios) != set(sources) or any(not sources[n] for n in sources) or min(ratios.values()) <= 0:
            raise ValueError("every source needs documents and a positive sampling ratio")
        if any(len(docs) < streams for docs in sources.values()):
            raise ValueError(f"every source needs at least {streams} documents (one per stream)")
        self.sources, self.ratios = dict(sources), dict(ratios)
        self.seq_len, self.streams, self.seed = seq_len, streams, seed
        self.checkpoint_every: int | None = None
        self.state_round_trips = 0
        self.steps = 0  # batches taken
        self._prefetched: tuple[int, list[dict[str, Any]]] | None = None  # (step, states)
        self._workers: list[ReadWorker] = []
        self._stop_workers = weakref.finalize(self, _stop, self._workers)
        self.readers = [_StreamReader(s, self, {n: 0 for n in sources}, 0, 0, [])
                        for s in range(dp_rank, streams, dp_size)]

    def plan_checkpoints(self, every: int) -> None:
        """The state will be collected after every ``every``-th batch: prefetch it one step ahead."""
        if not (isinstance(every, int) and every >= 1):
            raise ValueError(f"the checkpoint interval must be an integer >= 1, not {every!r}")
        self.checkpoint_every = every

    def next_batch(self) -> list[list[int]]:
        workers = self._running()
        for worker in workers:
            if not worker.ahead:  # the first batch since the workers started
                worker.request_next(self._is_checkpoint_step(self.steps + 1))
        taken = [worker.take() for worker in workers]
        self.steps += 1
        snapshots = [snapshot for _, snapshot in taken]
        self._prefetched = (self.steps, snapshots) if None not in snapshots else None
        for worker in workers:  # read the next step while the trainer computes this one
            worker.request_next(self._is_checkpoint_step(self.steps + 1))
        return [sequence for sequence, _ in taken]

    def _is_checkpoint_step(self, step: int) -> bool:
        return self.checkpoint_every is not None and step % self.checkpoint_every == 0

    def replicated_state(self) -> dict[str, Any]:
        return {"streams": self.streams, "seq_len": self.seq_len, "seed": self.seed, "ratios": self.ratios,
                "documents": {name: len(docs) for name, docs in self.sources.items()}}

    def sharded_states(self) -> list[dict[str, Any]]:
        if self._prefetched is not None and self._prefetched[0] == self.steps:
            return self._prefetched[1]
        self.state_round_trips += 1
        workers = self._running()
        for worker in workers:  # every worker builds its state at once
            worker.ask_state()
        return [worker.answer_state() for worker in workers]

    def load_dataloader_state(self, replicated: Any, sharded: list[Any]) -> None:
        if replicated != self.replicated_state():
            raise MismatchError(f"the token stream loader was saved with {replicated} and is now {self.replicated_state()}",
                                key="dataloader/replicated")
        if not sharded:
            raise MismatchError(f"this DP rank received no stream: the job has {self.streams} streams, fewer than "
                                "the DP ranks", key="dataloader")
        readers = [_StreamReader(int(s["stream"]), self, {n: int(s["offsets"][n]) for n in self.sources},
                                 int(s["draws"]), int(s.get("emitted", 0)), s["buffer"].tolist()) for s in sharded]
        _stop(self._workers)
        self.readers = sorted(readers, key=lambda r: r.stream)
        self.steps, self._prefetched = self.readers[0].emitted, None  # streams step together

    def close(self) -> None:
        """Stop the read workers (they also stop when the loader is collected)."""
        _stop(self._workers)

    def _running(self) -> list[ReadWorker]:
        """The read workers, started on first use: until then the readers are the loader's alone."""
        if not self._workers:
            self._workers.extend(ReadWorker(reader, f"bcp-read-stream{reader.stream}") for reader in self.readers)
        return self._workers


def _stop(workers: list[ReadWorker]) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()
