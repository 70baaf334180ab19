"""Where a checkpoint lives on storage: generations, the manifest, data files and the commit marker.

A checkpoint path holds generations ``gen-00000001/``, ``gen-00000002/``, ...; saving again writes a
new generation and the newest committed one is the checkpoint. A writer first claims its generation
(``CLAIM``, create-if-absent), so two writers never share one; it is committed once its
``COMMITTED`` marker exists (created last, create-if-absent, no rename needed). After a commit the
newest ``keep_generations`` committed generations stay, so a reader of the previous one is not
broken by a concurrent save; so does every generation whose data files a kept generation lists
(an incremental save's, ``layout.references``), and every one a save in progress may refer to.

A save that fails or is abandoned leaves nothing: its generation is removed whole once every rank
has stopped writing into it. Where that is unknown (a rank died or hung), its files are removed and
its claim is kept, marked discarded, so that no late write of that rank can land in a later save
that takes the same number; the next commit removes it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass

from bcp.engine.checksum import crc_of
from bcp.errors import CheckpointNotCommittedError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from bcp.layout.manifest import SHARD_TABLE, Manifest
from bcp.layout.manifest_files import earlier_generations
from bcp.layout.markers import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Claim, CommitMarker
from bcp.layout.references import generation_dir, split_reference
from bcp.storage.base import Storage

logger = logging.getLogger("bcp")

MANIFEST = "manifest.json"
COMMIT_MARKER = "COMMITTED"
CLAIM = "CLAIM"
DATA_DIR = "data"
#: The metrics log's folder beside the generations (bcp.api.metrics_log); never a generation.
METRICS_DIR = "bcp-metrics"
DEFAULT_KEEP_GENERATIONS = 2
_GENERATION = re.compile(r"gen-(\d{8})")
_DATA_FILE = re.compile(rf"{DATA_DIR}/(\d{{5}})-\d{{2}}\.bin")
_OPEN_TRIES = 3  # a generation removed while being opened is retried on the newest committed one


def data_file_name(rank: int, index: int) -> str:
    return f"{DATA_DIR}/{rank:05d}-{index:02d}.bin"


def writer_of_data_file(name: str) -> int | None:
    """The rank that wrote the data file ``name`` (as :func:`data_file_name` names it); None for
    another name."""
    match = _DATA_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Location:
    """A checkpoint root on a storage: ``prefix`` is ``""`` or ``"<role>/"``. ``keep_generations``
    committed generations survive each commit (at least 1)."""

    storage: Storage
    prefix: str
    display: str
    keep_generations: int = DEFAULT_KEEP_GENERATIONS

    @property
    def target(self) -> str:
        """The checkpoint in one string, the same for every process naming it (the storage's absolute
        root, the role): what the ranks of one save compare."""
        return f"{self.storage.root}/{self.prefix}"

    def name(self, generation: int, relative: str) -> str:
        return f"{self.prefix}{generation_dir(generation)}/{relative}"

    def generations(self) -> list[int]:
        found = (_GENERATION.fullmatch(n) for n in self.storage.list_dir(self.prefix.rstrip("/")))
        return sorted(int(m.group(1)) for m in found if m)

    def is_committed(self, generation: int) -> bool:
        return self.storage.exists(self.name(generation, COMMIT_MARKER))

    def may_refer_to(self, file: str) -> bool:
        """Whether a new generation may list ``file`` (named from the checkpoint path) of an earlier
        committed generation: everywhere the location's storage is the one that generation is on."""
        return True

    def data_name(self, generation: int, file: str) -> str:
        """The storage name of data file ``file`` listed by ``generation``'s manifest: in that
        generation's folder, or in the folder of the earlier generation it names
        (``gen-<n>/...``, which a manifest lists only from format version 3, ``layout.references``)."""
        return f"{self.prefix}{file}" if split_reference(file) is not None else self.name(generation, file)

    def claim_next_generation(self) -> int:
        """Claim the generation after the newest on storage (see :meth:`claim`)."""
        return self.claim()[0]

    def claim(self, base: int | None = None) -> tuple[int, str]:
        """Claim the generation after the newest on storage (create-if-absent of its ``CLAIM``; on
        a race, the next one): the caller alone writes into the generation returned. The claim
        holds a token of its own (returned, and read back by :meth:`claim_token`) and ``base``, the
        generation whose stored bytes the save may refer to: retention keeps it, and what it refers
        to, while the claim is in progress."""
        existing = self.generations()
        generation = existing[-1] + 1 if existing else 1
        token = secrets.token_hex(8)
        claim = Claim(token, base, socket.gethostname(), os.getpid(), time.time()).to_json()
        try:
            while not self.storage.put_if_absent(self.name(generation, CLAIM), claim):
                generation += 1
        except OSError as exc:  # a read-only or full file system, a folder without write permission
            raise StorageError(f"cannot claim generation {generation} (creating {generation_dir(generation)}/"
                               f"{CLAIM}): {exc.strerror or exc}", path=self.display) from exc
        return generation, token

    def claim_token(self, generation: int) -> str | None:
        """The token of ``generation``'s claim (None where it has none or cannot be read)."""
        claim = self.read_claim(generation)
        return claim.token if claim is not None else None

    def newest_committed(self) -> int | None:
        """The newest committed generation, None where there is none."""
        return next((g for g in reversed(self.generations()) if self.is_committed(g)), None)

    def latest_committed(self) -> int:
        """The newest committed generation; a clear error when there is none."""
        generations = self.generations()
        for generation in reversed(generations):
            if self.is_committed(generation):
                return generation
        if generations:
            raise CheckpointNotCommittedError(
                f"no committed checkpoint: generation(s) {generations} were started but never committed "
                "(the save failed, was interrupted or is still running)", path=self.display)
        if self.storage.exists(self.prefix + MANIFEST) or self.storage.exists(self.prefix + COMMIT_MARKER):
            raise CheckpointNotFoundError(
                "this is a generation folder; pass its parent checkpoint path", path=self.display)
        if not self.storage.exists(self.prefix.rstrip("/")):
            raise CheckpointNotFoundError("no such checkpoint path", path=self.display)
        raise CheckpointNotFoundError("not a bcp checkpoint (no gen-* folders)", path=self.display)

    def commit(self, generation: int, manifest: Manifest) -> None:
        """Write the shard table and the manifest, then the marker that makes the generation visible.
        The generation must still hold its claim (another writer's retention may have removed it),
        and every earlier generation whose files it lists must still be committed."""
        for earlier in sorted(manifest.earlier_generations()):
            if not self.is_committed(earlier):
                raise CheckpointNotCommittedError(
                    f"generation {generation} refers to data files of {generation_dir(earlier)}, which is no "
                    "longer committed (removed by something other than bcp's retention); nothing was committed",
                    path=self.display)
        self.commit_encoded(generation, *manifest.encode())

    def commit_encoded(self, generation: int, manifest_bytes: bytes, table_bytes: bytes) -> None:
        """:meth:`commit` of a manifest already encoded (a memory tier's node folders all commit
        the bytes one rank assembled)."""
        self._check_claimed(generation)
        self.storage.write_file(self.name(generation, SHARD_TABLE), [memoryview(table_bytes)])
        self.storage.write_file(self.name(generation, MANIFEST), [memoryview(manifest_bytes)])
        marker = CommitMarker(generation, len(manifest_bytes), crc_of(memoryview(manifest_bytes)))
        self._check_claimed(generation)
        if not self.storage.put_if_absent(self.name(generation, COMMIT_MARKER), marker.to_json()):
            raise CheckpointNotCommittedError(
                f"generation {generation} was committed by another writer", path=self.display)

    def _check_claimed(self, generation: int) -> None:
        if not self.storage.exists(self.name(generation, CLAIM)):
            raise CheckpointNotCommittedError(
                f"{generation_dir(generation)} was removed while it was being written (another writer "
                "saving to this path committed newer generations and retired it); nothing was committed",
                path=self.display)

    def read_latest_manifest_files(self) -> tuple[int, bytes, bytes]:
        """The newest committed generation and its manifest files (see :meth:`read_manifest_files`).
        A generation that another writer's retention removes while it is opened is skipped for the
        newest committed one."""
        for _ in range(_OPEN_TRIES - 1):
            generation = self.latest_committed()
            try:
                return generation, *self.read_manifest_files(generation)
            except CheckpointNotCommittedError:
                if self.latest_committed() == generation:
                    raise
        generation = self.latest_committed()
        return generation, *self.read_manifest_files(generation)

    def read_manifest_files(self, generation: int) -> tuple[bytes, bytes]:
        """The committed manifest's bytes (checked against the marker) and its shard table's bytes
        (checked when the manifest is parsed). Sizes are checked before anything is read."""
        where = f"{self.display}/{generation_dir(generation)}"
        try:
            size = self.storage.size(self.name(generation, COMMIT_MARKER))
            if size > MAX_MARKER_BYTES:
                raise CorruptCheckpointError(f"commit marker is {size} bytes, not a bcp marker", path=where)
            marker = CommitMarker.parse(self.storage.read_bytes(self.name(generation, COMMIT_MARKER)), generation, where)
            size = self.storage.size(self.name(generation, MANIFEST))
            data = self.storage.read_bytes(self.name(generation, MANIFEST)) if size == marker.manifest_bytes else b""
            if len(data) != marker.manifest_bytes or marker.manifest_crc32c != crc_of(memoryview(data)):
                raise CorruptCheckpointError("manifest does not match the checksum in the commit marker", path=where)
            table = self.storage.read_bytes(self.name(generation, SHARD_TABLE))
        except FileNotFoundError as exc:
            if not self.storage.exists(f"{self.prefix}{generation_dir(generation)}"):
                raise CheckpointNotCommittedError(
                    "the generation was removed while it was being opened (a newer save's retention)",
                    path=where) from None
            raise CheckpointNotCommittedError(f"generation is missing {exc.filename or exc}", path=where) from None
        except OSError as exc:
            raise CorruptCheckpointError(f"cannot read {exc.filename or 'a metadata file'}: {exc.strerror or exc}",
                                         path=where) from None
        return data, table

    def apply_retention(self, generation: int, earlier: set[int] | None = None) -> int | None:
        """Retention once ``generation`` is committed: the newest ``keep_generations`` committed
        generations up to it stay, and so does every newer generation (another writer's save in
        progress); generations older than the oldest one kept are removed, except those whose data
        files a kept generation lists or a save in progress may refer to (:meth:`needed_earlier`),
        and so are the older remains of failed saves (:meth:`discard`).
        ``earlier``: the generations ``generation``'s manifest lists files of, where known. Returns the
        oldest generation kept (None if none is committed)."""
        generations = self.generations()
        committed = [g for g in generations if g <= generation and self.is_committed(g)]
        kept = committed[-max(1, self.keep_generations):]
        if not kept:
            return None
        discarded = [g for g in generations if g < generation and g not in committed and self.is_discarded(g)]
        for g in discarded:
            self.storage.delete_tree(f"{self.prefix}{generation_dir(g)}")
        older = [g for g in generations if g < kept[0] and g not in discarded]
        if older:
            in_progress = [g for g in generations
                           if g > kept[0] and g not in kept and g not in discarded and not self.is_committed(g)]
            needed = self.needed_earlier(kept, in_progress, {generation: earlier} if earlier is not None else {})
            for g in older if needed is not None else ():
                if g not in needed:
                    self.storage.delete_tree(f"{self.prefix}{generation_dir(g)}")
        return kept[0]

    def needed_earlier(self, kept: list[int], in_progress: list[int],
                       known: dict[int, set[int]]) -> set[int] | None:
        """The generations whose data files the ``kept`` generations list (``known[g]`` where the
        caller has it, else read from the manifest), and those a save in progress may refer to: the
        base its claim names and every generation that one lists. None where a manifest that may
        list some cannot be read: then nothing older may be removed."""
        needed: set[int] = set()
        for generation in kept:
            found = known[generation] if generation in known else self.earlier_of(generation)
            if found is None:
                return None
            needed |= found
        for generation in in_progress:
            claim = self.read_claim(generation)
            base = claim.base if claim is not None else None
            if base is not None:
                found = self.earlier_of(base)
                if found is None:
                    return None
                needed |= {base} | found
        return needed

    def earlier_of(self, generation: int) -> set[int] | None:
        """The earlier generations whose data files ``generation``'s manifest lists. A manifest that
        is missing or is not one lists none (that generation cannot be loaded, so it needs nothing);
        None where it cannot be read now (retention then removes nothing it may need)."""
        try:
            if self.storage.size(self.name(generation, MANIFEST)) > MAX_MANIFEST_BYTES:
                return set()
            data = self.storage.read_bytes(self.name(generation, MANIFEST))
            if b'"gen-' not in data:  # no file of an earlier generation can be listed: skip parsing
                return set()
            return earlier_generations(data, generation)
        except FileNotFoundError:
            return set()
        except OSError as exc:
            logger.warning("bcp: cannot read the manifest of %s/%s (%s): retention keeps every older generation",
                           self.display, generation_dir(generation), exc)
            return None

    def read_claim(self, generation: int) -> Claim | None:
        """``generation``'s claim (None where there is none, it cannot be read, or it is not a claim)."""
        try:
            if self.storage.size(self.name(generation, CLAIM)) > MAX_MARKER_BYTES:
                return None
            return Claim.from_json(self.storage.read_bytes(self.name(generation, CLAIM)))
        except OSError:
            return None

    def discard(self, generation: int, every_writer_stopped: bool = False) -> None:
        """Best effort after a failed save: remove ``generation`` unless it is committed. With
        ``every_writer_stopped`` (every rank reported the end of its writes), the folder goes whole
        and its number may be claimed again. Otherwise its claim stays, marked discarded, so that
        the number is not handed out while a rank might still write into it; the next commit's
        retention removes it."""
        if self.is_committed(generation):
            return
        folder = f"{self.prefix}{generation_dir(generation)}"
        try:
            if every_writer_stopped:
                self.storage.delete_tree(folder)
                return
            for child in self.storage.list_dir(folder):
                if child != CLAIM:
                    self.storage.delete_tree(f"{folder}/{child}")
            claim = Claim.from_json(self.storage.read_bytes(self.name(generation, CLAIM)))
            if claim is not None:
                self.storage.write_file(self.name(generation, CLAIM), [memoryview(claim.marked_discarded().to_json())])
        except OSError:
            pass  # best effort: the save's own error is the one to report

    def is_discarded(self, generation: int) -> bool:
        """Whether ``generation`` is the remains of a failed save (its claim marked by :meth:`discard`)."""
        claim = self.read_claim(generation)  # None: no claim (being removed), or not bcp's JSON
        return claim is not None and claim.discarded
