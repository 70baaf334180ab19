"""Reading a memory-tier generation on the live ranks (``api.load.ReadSource``): the manifest from a
rank whose node folder committed it, this rank's reads from its own folder where it holds the file,
and from a peer that holds it otherwise. Before the reads run, every rank's missing byte ranges (the
saved shards its reads touch, and the value records) are assigned to holders, least loaded first,
and sent over the process group; the reader then checks them against their checksums."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

from bcp.api.checkpoint import Checkpoint
from bcp.api.options import LoadOptions
from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, all_agree, broadcast_from_root
from bcp.engine.location import Location, generation_dir
from bcp.layout.manifest import Manifest
from bcp.layout.read_op import ReadOp
from bcp.storage import LocalStorage
from bcp.tier.overlay import OverlayStorage
from bcp.tier.recovery import Choice
from bcp.tier.transfer import Transfer, run_transfers


@dataclass(frozen=True)
class _Recovered(Location):
    """The chosen generation's folder as read through the overlay. The census found each of its
    files, those of the ``earlier`` generations it lists too, in a live folder that committed it
    (``tier.recovery``): those generations count as committed here, whatever this folder holds
    of them (a replaced node's holds copies only, or nothing)."""

    earlier: frozenset[int] = frozenset()

    def is_committed(self, generation: int) -> bool:
        return generation in self.earlier or super().is_committed(generation)


class PeerSource:
    """Generation ``choice.generation`` read through this rank's node folder ``folder`` and its peers."""

    def __init__(self, folder: Location, choice: Choice, display: str) -> None:
        assert choice.generation is not None
        self.folder = folder
        self.choice = choice
        self.generation = choice.generation
        self.display = display
        #: Bytes this rank received from peers.
        self.fetched = 0
        self._overlay: OverlayStorage | None = None

    def open(self, coord: Coordinator, options: LoadOptions) -> Checkpoint:
        generation = self.generation
        where = f"{self.display}/{generation_dir(generation)}"
        data, table = self._manifest_files(coord, f"opening {where}")
        manifest = Manifest.decode(data, table, path=where)
        own = {name for name, ranks in self.choice.holders.items() if coord.rank in ranks}
        storage = self.folder.storage
        assert isinstance(storage, LocalStorage)
        self._overlay = OverlayStorage(storage, {self.folder.data_name(generation, name) for name in own},
                                       {self.folder.data_name(generation, name): size
                                        for name, size in self.choice.sizes.items()})
        location = _Recovered(self._overlay, self.folder.prefix, self.display, self.folder.keep_generations,
                              frozenset(manifest.earlier_generations()))
        return Checkpoint(location, generation, manifest, verify=options.verify, io_threads=options.io_threads)

    def _manifest_files(self, coord: Coordinator, what: str) -> list[bytes]:
        """The manifest's and shard table's bytes on every rank: read by the lowest rank whose folder
        committed the generation, sent to rank 0 if that is another rank, broadcast from there."""
        provider = min(self.choice.holding)
        read = Outcome.of(lambda: list(self.folder.read_manifest_files(self.generation))) \
            if coord.rank == provider else Outcome()
        if provider != 0:
            sizes = all_agree(coord, Outcome([len(part) for part in read.value] if read.value else None, read.error),
                              what)[provider]
            blob = b"".join(read.value) if read.value else b""
            parts: list[memoryview] = []

            def send(transfer: Transfer, start: int, into: memoryview) -> None:
                into[:] = blob[start:start + into.nbytes]

            def received(transfer: Transfer, chunks: Iterator[memoryview]) -> None:
                parts.extend(bytes(chunk) for chunk in chunks)

            moved = Outcome.of(lambda: run_transfers(coord, [Transfer(provider, 0, "manifest", 0, sum(sizes))],
                                                     send, received))
            joined = b"".join(parts)
            read = Outcome([joined[:sizes[0]], joined[sizes[0]:]] if coord.rank == 0 else None, moved.error)
        return broadcast_from_root(coord, read, what)

    def gather(self, coord: Coordinator, checkpoint: Checkpoint, ops: list[ReadOp] | None) -> None:
        overlay = self._overlay
        assert overlay is not None
        files = checkpoint.manifest.files
        # The stored bytes of each range: its chunks as they lie in the file, compressed or not.
        wanted = [(op.shard.bytes.file, op.shard.bytes.offset, op.shard.bytes.stored_nbytes) for op in ops or ()]
        wanted += [(where.file, where.offset, where.stored_nbytes) for entry in checkpoint.objects.values()
                   for where, _ in entry.records]
        missing = sorted({(files[f], offset, nbytes) for f, offset, nbytes in wanted
                          if self.folder.data_name(self.generation, files[f]) not in overlay.local_names})
        what = f"fetching {self.display} from peer nodes"
        every_rank = all_agree(coord, Outcome([list(row) for row in missing]), what)
        load: dict[int, int] = defaultdict(int)
        transfers = []
        for rank, rows in enumerate(every_rank):
            for name, offset, nbytes in rows:
                holder = min(self.choice.holders[name], key=lambda r: (load[r], r))
                load[holder] += nbytes
                transfers.append(Transfer(holder, rank, name, offset, nbytes))

        def read(transfer: Transfer, start: int, into: memoryview) -> None:
            self.folder.storage.read_into(self.folder.data_name(self.generation, transfer.name),
                                          transfer.offset + start, into)

        def received(transfer: Transfer, chunks: Iterator[memoryview]) -> None:
            buffer = bytearray(transfer.nbytes)
            position = 0
            for chunk in chunks:
                buffer[position:position + chunk.nbytes] = chunk
                position += chunk.nbytes
            overlay.add(self.folder.data_name(self.generation, transfer.name), transfer.offset, memoryview(buffer))

        moved = Outcome.of(lambda: run_transfers(coord, transfers, read, received))
        all_agree(coord, Outcome(None, moved.error), what)
        self.fetched = moved.value
