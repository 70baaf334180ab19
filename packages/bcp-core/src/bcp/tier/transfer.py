"""Moving file bytes between ranks over the coordinator's process group (gloo on CPU, whatever the
training uses), in fixed-size chunks so that memory holds a chunk per transfer, not a file.

Every rank lists the same transfers in the same order (by sender, then receiver, then file and
chunk): each rank sends its transfers in that order on one thread and receives its own in that
order on another, so the earliest unfinished transfer always has both ends waiting on it and no
two ranks wait on each other."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from bcp.coord import Coordinator
from bcp.errors import DistributedError

CHUNK_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Transfer:
    """``nbytes`` bytes from ``offset`` of file ``name``, from rank ``sender`` to rank ``receiver``."""

    sender: int
    receiver: int
    name: str
    offset: int
    nbytes: int


def run_transfers(coord: Coordinator, transfers: list[Transfer], read: Callable[[Transfer, int, memoryview], None],
                  received: Callable[[Transfer, Iterator[memoryview]], None]) -> int:
    """Collective over every rank ``transfers`` names (the same list on every rank). This rank reads
    what it sends with ``read(transfer, start, into)`` and hands what it receives, chunk by chunk, to
    ``received(transfer, chunks)`` (which must consume them all). Returns the bytes received."""
    if not transfers:
        return 0
    group = coord.process_group()
    if group is None:
        raise DistributedError("the memory tier moves files between ranks over the coordinator's process "
                               "group; this coordinator has none (use the torch.distributed coordinator)")
    transfers = sorted(transfers, key=lambda t: (t.sender, t.receiver))
    tags = _tags(transfers)
    sending = [t for t in transfers if t.sender == coord.rank and t.receiver != coord.rank]
    failure: list[BaseException] = []

    def send_all() -> None:
        buffer = torch.empty(min(CHUNK_BYTES, max((t.nbytes for t in sending), default=0)), dtype=torch.uint8)
        for transfer in sending:
            for index, start in enumerate(range(0, transfer.nbytes, CHUNK_BYTES)):
                chunk = buffer[:min(CHUNK_BYTES, transfer.nbytes - start)]
                if not failure:
                    try:
                        read(transfer, start, memoryview(chunk.numpy()))
                    except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
                        failure.append(exc)
                # after a failure, zeros go on: the receivers never wait for a chunk that does not come
                # (the save fails at its next agreement, so they are never used)
                group.isend(chunk, transfer.receiver, tags[id(transfer)] + index).wait()

    def send_or_fail() -> None:
        try:
            send_all()
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
            failure.append(exc)

    sender = threading.Thread(target=send_or_fail, name="bcp-tier-send", daemon=True)
    sender.start()
    total = 0
    try:
        for transfer in transfers:
            if transfer.receiver != coord.rank or transfer.sender == coord.rank:
                continue
            chunks = _chunks(group, transfer, tags[id(transfer)])
            try:
                received(transfer, chunks)
            except DistributedError as exc:  # the transport failed: no later chunk comes either
                failure.append(exc)
                break
            except BaseException as exc:  # noqa: BLE001 - raised below, once the peers are served
                failure.append(exc)
            for _ in chunks:  # what the consumer left (it failed): the sender still sends it
                pass
            total += transfer.nbytes
    finally:
        sender.join()
    if failure:
        raise failure[0]
    return total


def _chunks(group: Any, transfer: Transfer, tag: int) -> Iterator[memoryview]:
    for index, start in enumerate(range(0, transfer.nbytes, CHUNK_BYTES)):
        chunk = torch.empty(min(CHUNK_BYTES, transfer.nbytes - start), dtype=torch.uint8)
        try:
            group.irecv(chunk, transfer.sender, tag + index).wait()
        except Exception as exc:  # a dead or hung peer: gloo's timeout or connection error
            raise DistributedError(f"receiving {transfer.name} from rank {transfer.sender} failed: {exc}") from exc
        yield memoryview(chunk.numpy())


def _tags(transfers: list[Transfer]) -> dict[int, int]:
    """The first message tag of each transfer (one tag per chunk, unique in the exchange)."""
    tags, tag = {}, 0
    for transfer in transfers:
        tags[id(transfer)] = tag
        tag += max(1, -(-transfer.nbytes // CHUNK_BYTES))
    return tags
