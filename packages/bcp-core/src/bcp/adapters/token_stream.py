"""A reference resumable loader for token streams that implements :class:`ShardedDataloader`.

The data is cut into ``streams`` (fixed when training first starts): stream ``s`` owns document
``i`` of every source where ``i % streams == s``, and is read by one read worker that draws a
source by the sampling ratios, appends the document to its token buffer and emits packed
sequences of ``seq_len`` tokens. A step takes one sequence from every stream, so the global batch
(``streams`` sequences) and what each stream has consumed after ``n`` steps do not depend on the
DP size: stream ``s`` is read by DP rank ``s % dp_size``. Each stream's state (per-source offsets,
draws, buffered tokens) is one sharded part; the sources, ratios and stream count are replicated.
Deterministic and in-process: the source choice of draw ``n`` is a pure function of
``(seed, stream, n)``.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

import torch

from bcp.errors import MismatchError


class _StreamReader:
    """One stream: its position in every source and the tokens read but not yet emitted."""

    def __init__(self, stream: int, sources: Mapping[str, Sequence[Sequence[int]]], offsets: dict[str, int],
                 draws: int, buffer: list[int]) -> None:
        self.stream, self.sources, self.offsets, self.draws, self.buffer = stream, sources, offsets, draws, buffer

    def next_sequence(self, seq_len: int, streams: int, seed: int, ratios: Mapping[str, float]) -> list[int]:
        names = list(ratios)
        while len(self.buffer) < seq_len:
            chooser = random.Random(f"{seed}:{self.stream}:{self.draws}")
            name = chooser.choices(names, weights=[ratios[n] for n in names])[0]
            documents = self.sources[name]
            share = range(self.stream, len(documents), streams)  # this stream's documents, read in epochs
            self.buffer.extend(documents[share[self.offsets[name] % len(share)]])
            self.offsets[name] += 1
            self.draws += 1
        sequence, self.buffer = self.buffer[:seq_len], self.buffer[seq_len:]
        return sequence

    def state(self) -> dict[str, Any]:
        return {"stream": self.stream, "offsets": dict(self.offsets), "draws": self.draws,
                "buffer": torch.tensor(self.buffer, dtype=torch.int64)}


class TokenStreamLoader:
    """Packed token sequences from several sources mixed by sampling ratios, for one DP rank.

    ``sources``: name -> documents (token id lists); ``ratios``: name -> sampling weight;
    ``streams``: read workers over the whole job (a fresh start deals stream ``s`` to DP rank
    ``s % dp_size``; after a load, the rank reads the streams it was given). ``next_batch()`` returns
    one sequence per stream this rank reads, in stream order.
    """

    def __init__(self, sources: Mapping[str, Sequence[Sequence[int]]], ratios: Mapping[str, float], *,
                 seq_len: int, streams: int, dp_rank: int, dp_size: int, seed: int = 0) -> None:
        if set(ratios) != set(sources) or any(not sources[n] for n in sources) or min(ratios.values()) <= 0:
            raise ValueError("every source needs documents and a positive sampling ratio")
        if any(len(docs) < streams for docs in sources.values()):
            raise ValueError(f"every source needs at least {streams} documents (one per stream)")
        self.sources, self.ratios = dict(sources), dict(ratios)
        self.seq_len, self.streams, self.seed = seq_len, streams, seed
        self.readers = [self._reader(s, {n: 0 for n in sources}, 0, []) for s in range(dp_rank, streams, dp_size)]

    def _reader(self, stream: int, offsets: dict[str, int], draws: int, buffer: list[int]) -> _StreamReader:
        return _StreamReader(stream, self.sources, offsets, draws, buffer)

    def next_batch(self) -> list[list[int]]:
        return [r.next_sequence(self.seq_len, self.streams, self.seed, self.ratios) for r in self.readers]

    def replicated_state(self) -> dict[str, Any]:
        return {"streams": self.streams, "seq_len": self.seq_len, "seed": self.seed, "ratios": self.ratios,
                "documents": {name: len(docs) for name, docs in self.sources.items()}}

    def sharded_states(self) -> list[dict[str, Any]]:
        return [reader.state() for reader in self.readers]

    def load_dataloader_state(self, replicated: Any, sharded: list[Any]) -> None:
        if replicated != self.replicated_state():
            raise MismatchError(f"the token stream loader was saved with {replicated} and is now {self.replicated_state()}",
                                key="dataloader/replicated")
        if not sharded:
            raise MismatchError(f"this DP rank received no stream: the job has {self.streams} streams, fewer than "
                                "the DP ranks", key="dataloader")
        readers = [self._reader(int(s["stream"]), {n: int(s["offsets"][n]) for n in self.sources}, int(s["draws"]),
                                s["buffer"].tolist()) for s in sharded]
        self.readers = sorted(readers, key=lambda r: r.stream)
