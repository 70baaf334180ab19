"""A whole compressed load from an object store (a real SeaweedFS behind a counting proxy) costs no
more requests than an uncompressed one, downloads the stored bytes alone, and decodes its chunks on
several reader threads at once, not one after another on one, even when the state is one file."""

from __future__ import annotations

import threading

import bcp
import torch
from bcp.engine.verification import ChunkDecoder
from bcp.storage import S3Storage
from bcp.tools import open_checkpoint
from s3_fault_proxy import FaultProxy

CODEC = "zstd"
TENSORS, ROWS, COLUMNS = 8, 1536, 1024  # 8 fp32 tensors of 6 MiB (6 chunks each), saved in one file


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(ROWS, COLUMNS, generator=generator) * 0.02 for i in range(TENSORS)}


def test_a_compressed_load_sends_the_same_gets_for_the_stored_bytes_and_decodes_in_parallel(s3_server, s3_url,
                                                                                             monkeypatch):
    decoding_threads: set[int] = set()
    decode = ChunkDecoder.decode

    def counted_decode(self, *args, **kwargs):  # the real decoder, its threads noted
        decoding_threads.add(threading.get_ident())
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(ChunkDecoder, "decode", counted_decode)
    proxy = FaultProxy(s3_server.endpoint)
    state = _state()
    gets, downloaded, stored = {}, {}, {}
    try:
        for name, compression in (("raw", None), ("zstd", CODEC)):
            storage = S3Storage(f"{s3_url}/{name}", **s3_server.options(proxy.endpoint))
            bcp.save(storage, {"model": state}, compression=compression)
            manifest_bytes = _manifest_bytes(storage, proxy)
            stored[name] = sum(sum(s.bytes.stored.nbytes) if s.bytes.stored else s.bytes.nbytes
                               for t in open_checkpoint(storage).tensors.values() for s in t.shards)
            loaded = {n: torch.zeros_like(t) for n, t in state.items()}
            decoding_threads.clear()
            proxy.reset_counts()
            bcp.load(storage, {"model": loaded}, io_threads=4)
            gets[name], downloaded[name] = proxy.requests["GET"], proxy.get_body_bytes - manifest_bytes
            for n, tensor in state.items():
                assert torch.equal(loaded[n].view(torch.int32), tensor.view(torch.int32)), n
            if compression:
                assert len(decoding_threads) > 1, decoding_threads
    finally:
        proxy.close()
    assert stored["zstd"] < stored["raw"] * 0.95, stored
    assert gets["zstd"] <= gets["raw"], gets
    assert downloaded == stored, (downloaded, stored)


def _manifest_bytes(storage: S3Storage, proxy: FaultProxy) -> int:
    """The bytes a load downloads before its data: those of a metadata-only open."""
    proxy.reset_counts()
    open_checkpoint(storage)
    return proxy.get_body_bytes
