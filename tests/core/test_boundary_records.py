"""The records that cross a boundary travel by field name: each comes back equal from its plain
data and from the bytes that carry it (msgpack between processes, JSON on storage), a field an
older sender did not know takes its default, and what older bcp versions wrote stays readable."""

from __future__ import annotations

import socket

import msgpack
import numpy as np
import pytest
import torch

from bcp.engine.process_wire import receive, send
from bcp.layout.box import Box
from bcp.layout.local_plan import LocalPlan
from bcp.layout.piece import Piece
from bcp.layout.read_op import ReadRequest, ReadRole
from bcp.layout.write_plan import RankAssignment, SplitPart
from bcp.engine.writer_jobs import (Abandon, Done, Failed, Failure, FileJob, ItemChunks, Padding, SharedBuffer,
                                    StagedPiece, Stop, ValueBytes, WriteJob, read_reply, read_request)


def _through_msgpack(record):
    return msgpack.unpackb(msgpack.packb(record.to_wire(), use_bin_type=True), raw=False)


def test_a_write_job_with_every_kind_of_item_comes_back_equal_through_a_socket():
    job = WriteJob(b"\x80storage", 1 << 20, True,
                   [FileJob("gen-00000001/data/00000-00.bin",
                            [Padding(17), StagedPiece(3, 4096, 64, [1, 2]), ValueBytes(b"\x00value", None)]),
                    FileJob("gen-00000001/data/00000-01.bin", [StagedPiece(3, 0, 8)])],
                   live=[3, 5], new=[SharedBuffer(5, 1 << 16)])
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        send(ours, job)
        received, fds = receive(theirs, read_request)
    assert received == job and fds == []
    assert isinstance(received.files[0].items[0], Padding) and received.files[0].items[2].data == b"\x00value"


@pytest.mark.parametrize("request_", [Abandon(), Stop()])
def test_the_stop_requests_come_back_as_themselves(request_):
    assert read_request(_through_msgpack(request_)) == request_


@pytest.mark.parametrize("reply", [Done([[[1, 2], []], [[3]]]),
                                   Done([[[1, 2], []], [[3]]], [[ItemChunks([2, 0], [5, 9], [7, 8]), None], [None]]),
                                   Failed(Failure.ABANDONED, "the save was abandoned"),
                                   Failed(Failure.STORAGE, "[Errno 28] No space left on device"),
                                   Failed(Failure.ERROR, "Traceback (most recent call last): ...")])
def test_a_reply_of_each_kind_comes_back_equal(reply):
    assert read_reply(_through_msgpack(reply)) == reply


def test_a_field_an_older_sender_did_not_know_takes_its_default_and_an_unknown_one_is_ignored():
    wire = _through_msgpack(StagedPiece(1, 2, 3, [4]))
    del wire["crcs"]
    wire["placement"] = "a field of a newer sender"
    assert read_request({**_through_msgpack(Stop()), "later": 1}) == Stop()
    assert StagedPiece.from_wire(wire) == StagedPiece(1, 2, 3, None)
    with pytest.raises(ValueError, match="nbytes"):
        StagedPiece.from_wire({"buffer": 1, "offset": 2})
    with pytest.raises(ValueError, match="unknown kind"):
        read_reply({"kind": "maybe"})


def test_an_older_claim_and_a_memory_tier_claim_read_and_write_with_the_same_keys():
    from bcp.layout.markers import Claim

    older = b'{"host": "node-3", "pid": 4242, "unix": 1700000000.5, "token": "0123456789abcdef", "base": 7}'
    claim = Claim.from_json(older)
    assert (claim.host, claim.pid, claim.unix, claim.token, claim.base, claim.discarded) == \
        ("node-3", 4242, 1700000000.5, "0123456789abcdef", 7, False)
    assert claim.to_json() == older  # rewritten, an older claim keeps its keys and their order
    tier = Claim("feedface00000000", None, pid=11).to_json()
    assert tier == b'{"pid": 11, "token": "feedface00000000"}'
    discarded = Claim.from_json(b'{"base": 2, "later": [1]}').marked_discarded()
    assert discarded.to_json() == b'{"base": 2, "discarded": true, "later": [1]}'
    assert Claim.from_json(discarded.to_json()).discarded
    assert Claim.from_json(b"[]") is None and Claim.from_json(b"not json") is None
    assert Claim.from_json(b'{"base": true, "token": 5}') == Claim()  # wrong types read as absent


def test_a_commit_marker_an_older_bcp_wrote_is_read_and_a_wrong_one_named(tmp_path):
    from bcp.errors import CorruptCheckpointError, FormatVersionError
    from bcp.layout.markers import CommitMarker

    older = b'{"format": "bcp", "version": 1, "generation": 3, "manifest_bytes": 812, "manifest_crc32c": 3735928559}'
    marker = CommitMarker.parse(older, 3, "ckpt/gen-00000003")
    assert marker == CommitMarker(3, 812, 3735928559) and marker.to_json() == older
    with pytest.raises(CorruptCheckpointError, match="names generation 3, not 4"):
        CommitMarker.parse(older, 4, "ckpt/gen-00000004")
    with pytest.raises(FormatVersionError, match="version 2"):
        CommitMarker.parse(older.replace(b'"version": 1', b'"version": 2'), 3, "ckpt/gen-00000003")


def test_a_proposal_and_a_rank_report_come_back_equal_by_field_name():
    from bcp.api.plan_agreement import Proposal
    from bcp.api.writing import RankReport
    from bcp.layout.write_report import PieceRecord, RankWrites, ValueRecord, WrittenPieces

    proposal = Proposal(True, 5, 3, 2**63 + 1, [0, 1], [["extra", 7]], [["ema/w", 9]], 2, True, [1, 2])
    assert Proposal.from_wire(_through_msgpack(proposal)) == proposal
    older = {key: value for key, value in proposal.to_wire().items() if key not in ("base", "continuous", "remembered")}
    assert Proposal.from_wire(older) == Proposal(True, 5, 3, 2**63 + 1, [0, 1], [["extra", 7]], [["ema/w", 9]])

    rows = [PieceRecord(0, None, None, 0, 0, 8, [11]), PieceRecord(1, (2,), (3,), 1, 64, 12, [12, 13])]
    writes = RankWrites(["data/00000-00.bin", "data/00000-01.bin"], WrittenPieces.of(rows),
                        [ValueRecord("rng", 0, 8, 5, 5, [14], [0, 1])], False, True,
                        WrittenPieces.of([PieceRecord(2, None, None, 0, 0, 4, [15])]), ["gen-00000001/data/00000-00.bin"])
    back = RankReport.from_wire(_through_msgpack(RankReport(writes, ["rank record"]))).writes
    assert back.files == writes.files and back.values == writes.values and back.earlier_files == writes.earlier_files
    for column in ("index", "where", "crc_counts", "crcs"):
        assert (getattr(back.pieces, column) == getattr(writes.pieces, column)).all()
        assert (getattr(back.reused, column) == getattr(writes.reused, column)).all()
    assert back.pieces.parts == writes.pieces.parts and (back.used_pickle, back.used_refs) == (False, True)


def test_a_local_plan_an_assignment_and_the_read_once_lists_travel_by_field_name():
    pieces = [Piece("w", torch.float32, (4, 3), Box((0, 0), (2, 3)), torch.zeros(2, 3)),
              Piece("b", torch.float32, (3,), Box((1,), (2,)), torch.zeros(2))]
    plan = LocalPlan.of([("w", torch.float32, (4, 3)), ("b", torch.float32, (3,))], pieces, [7, 9])
    wire = _through_msgpack(plan)
    assert {"version", "tensors", "ndim", "tensor", "offsets", "lengths", "replica_crcs"} <= set(wire)
    back = LocalPlan.from_wire(wire)
    assert back.tensors == [["w", "float32", [4, 3]], ["b", "float32", [3]]] and back.ndim == 2
    assert np.array_equal(back.offsets, plan.offsets) and np.array_equal(back.lengths, plan.lengths)
    assert back.replica_crcs.tolist() == [7, 9]
    without_crcs = {key: value for key, value in wire.items() if key != "replica_crcs"}  # an older sender's
    assert LocalPlan.from_wire(without_crcs).replica_crcs is None

    assignment = RankAssignment([0, 2], [SplitPart(1, (0, 0), (2, 3))])
    assert RankAssignment.from_wire(_through_msgpack(assignment)) == assignment

    requests = [ReadRequest("w", 0, (0, 0), (2, 3), 24), ReadRequest("b", 1, (1,), (2,), 8)]
    wire = msgpack.unpackb(msgpack.packb(ReadRequest.list_to_wire(requests)), raw=False)
    assert ReadRequest.list_from_wire(wire) == requests
    roles = [ReadRole(True, 3, (1, 2)), ReadRole(False, 3, (0,))]
    wire = msgpack.unpackb(msgpack.packb(ReadRole.list_to_wire(roles)), raw=False)
    assert ReadRole.list_from_wire(wire) == roles
