"""``bcp verify``: a checkpoint is complete (every data file present and long enough, every tensor
covered exactly once by its shards) and intact (every stored byte matches its checksum). Compressed
chunks (format version 4) are checked as stored, without decoding them; with ``decode`` they are
decoded too and their raw bytes checked."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from bcp.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from bcp.layout.manifest import ByteRange
from bcp.layout.references import generation_dir, referred_generation
from bcp.layout.values import decode_value
from bcp.storage import Storage
from bcp.tools.checkpoint import Checkpoint, open_checkpoint
from bcp.tools.progress import NoProgress, Progress

# Bytes read per request; a multiple of the checksum chunk so every request verifies whole chunks.
BLOCK_CHUNKS = 4


@dataclass
class Problem:
    entry: str | None
    message: str


@dataclass
class VerifyReport:
    path: str
    generation: int
    tensors: int = 0
    values: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def verify_checkpoint(path: "str | os.PathLike | Storage", *, role: str | None = None,
                      generation: int | None = None, progress: Progress | None = None,
                      decode: bool = False) -> VerifyReport:
    """Check the newest committed generation (or ``generation``) and report every problem found;
    a checkpoint that cannot be opened at all raises. ``decode``: compressed chunks are decoded and
    their raw bytes checked too (else their stored bytes only)."""
    checkpoint = open_checkpoint(path, role=role, generation=generation, verify=True)
    report = VerifyReport(checkpoint.path, checkpoint.generation)
    _Verifier(checkpoint, report, progress or NoProgress(), decode).run()
    return report


class _Verifier:
    def __init__(self, checkpoint: Checkpoint, report: VerifyReport, progress: Progress, decode: bool) -> None:
        self.checkpoint = checkpoint
        self.manifest = checkpoint.manifest
        self.report = report
        self.progress = progress
        self.decode = decode
        self.bad_files: set[int] = set()

    def problem(self, entry: str | None, message: str) -> None:
        self.report.problems.append(Problem(entry, message))

    def run(self) -> None:
        self.check_files()
        self.progress.start("verify", sum(self.checked_nbytes(r) for _, r in self.ranges() if r.file not in self.bad_files))
        try:
            for name, entry in self.manifest.tensors.items():
                self.check_coverage(name)
                if all(self.check_bytes(name, s.bytes) for s in entry.shards):
                    self.report.tensors += 1
            for name, entry in self.manifest.objects.items():
                if self.check_value(name, entry):
                    self.report.values += 1
        finally:
            self.progress.finish()

    def ranges(self) -> Iterator[tuple[str, ByteRange]]:
        yield from ((name, s.bytes) for name, e in self.manifest.tensors.items() for s in e.shards)
        yield from ((name, r) for name, e in self.manifest.objects.items() for r, _ in e.records)

    def check_files(self) -> None:
        """Each data file is a regular file that ends where the last range stored in it ends: shorter
        is truncation, longer is something appended (one problem per file). A file of an earlier
        generation (an incremental save's) must lie in a committed generation and hold the ranges
        this one uses; it may hold more (that generation's other entries)."""
        needed = [0] * len(self.manifest.files)
        users: list[set[str]] = [set() for _ in self.manifest.files]
        for name, r in self.ranges():
            needed[r.file] = max(needed[r.file], r.offset + r.stored_nbytes)
            users[r.file].add(name)
        storage, location = self.checkpoint.location.storage, self.checkpoint.location
        for index, file in enumerate(self.manifest.files):
            name = location.data_name(self.checkpoint.generation, file)
            affected = f"holds data of {len(users[index])} entries, e.g. {sorted(users[index])[:3]}"
            earlier = referred_generation(file)
            if earlier is not None and not location.is_committed(earlier):
                self.problem(None, f"data file {file} lies in {generation_dir(earlier)}, which is not committed "
                                   f"({affected})")
                self.bad_files.add(index)
                continue
            try:
                size = storage.size(name)
            except FileNotFoundError:
                self.problem(None, f"data file {file} is missing ({affected})")
                self.bad_files.add(index)
                continue
            except OSError as exc:
                self.problem(None, f"data file {file} cannot be read: {exc.strerror or exc} ({affected})")
                self.bad_files.add(index)
                continue
            if size < needed[index]:
                self.problem(None, f"data file {file} is truncated: {size} bytes, needs {needed[index]} ({affected})")
                self.bad_files.add(index)
            elif size > needed[index] and earlier is None:
                self.problem(None, f"data file {file} has {size - needed[index]} bytes after its last stored "
                                   f"range (appended or not written by bcp)")

    def check_coverage(self, name: str) -> None:
        """The reader door's exact coverage check (``layout.coverage``), as a load runs it."""
        try:
            self.checkpoint.check_covered([name])
        except CorruptCheckpointError as exc:
            self.problem(name, exc.message)

    def check_bytes(self, name: str, where: ByteRange) -> bool:
        """Read a stored range block by block; the reader checks every chunk's checksum (of a
        compressed range, the stored bytes' unless decoding)."""
        if where.file in self.bad_files:
            return False
        try:
            if where.stored is not None and not self.decode:
                self.check_stored(name, where)
                return True
            block = self.manifest.checksum_chunk * BLOCK_CHUNKS
            buffer = memoryview(bytearray(min(block, where.nbytes)))
            for start in range(0, where.nbytes, block):
                view = buffer[: min(block, where.nbytes - start)]
                self.checkpoint.read_range(where, start, view, name)
                self.advance(view.nbytes)
        except CheckpointError as exc:
            self.problem(name, _reason(exc))
            return False
        return True

    def check_stored(self, name: str, where: ByteRange) -> None:
        """A compressed range's chunks as stored, a few at a time, each checked against the checksum
        of its stored bytes (not decoded)."""
        starts = where.stored.starts()
        for first in range(0, len(starts) - 1, BLOCK_CHUNKS):
            end = min(first + BLOCK_CHUNKS, len(starts) - 1)
            view = memoryview(bytearray(starts[end] - starts[first]))
            self.checkpoint.read_stored(where, starts[first], view, name)
            self.advance(view.nbytes)

    def check_value(self, name: str, entry: Any) -> bool:
        """A value's records (small: each was one buffer at save time) must match their checksums and
        decode, so that its structure, not only its bytes, is sound."""
        for where, tree_nbytes in entry.records:
            if where.file in self.bad_files:
                return False
            record = memoryview(bytearray(where.nbytes))
            try:
                self.checkpoint.read_range(where, 0, record, name)
                self.advance(where.nbytes)
                decode_value(record, tree_nbytes, key=name, path=self.report.path, resolve=self.held_tensor)
            except UnsafeCheckpointError:
                pass  # pickled on purpose: its bytes are verified, unpickling it is not ours to do
            except CheckpointError as exc:
                self.problem(name, _reason(exc))
                return False
        return True

    def held_tensor(self, name: str) -> None:
        """A value's reference must name a tensor saved beside it (whose bytes are verified as its own entry)."""
        if name not in self.manifest.tensors and name not in self.manifest.objects:
            raise CorruptCheckpointError(f"a value refers to the tensor {name!r}, which the checkpoint does not hold",
                                         path=self.report.path, key=name)

    def checked_nbytes(self, where: ByteRange) -> int:
        """The bytes checking ``where`` reads: stored ones, unless decoding."""
        return where.stored_nbytes if where.stored is not None and not self.decode else where.nbytes

    def advance(self, nbytes: int) -> None:
        self.report.bytes_checked += nbytes
        self.progress.advance(nbytes)


def _reason(exc: CheckpointError) -> str:
    """The error's message without the location suffix that the report already shows."""
    text = str(exc)
    return text[: text.rfind(" (checkpoint")] if " (checkpoint" in text else text
