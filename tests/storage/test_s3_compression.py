"""Compressed checkpoints on an object store (a real SeaweedFS behind a counting proxy): a compressed
save uploads fewer bytes than an uncompressed one and loads bitwise; a slice read through
``read_tensor`` downloads only the stored bytes of the chunks that cover it, in one ranged GET."""

from __future__ import annotations

import bcp
import torch
from bcp.storage import S3Storage
from bcp.tools import open_checkpoint, read_tensor
from s3_fault_proxy import FaultProxy

CODEC = "zstd"
ROWS, COLUMNS = 2048, 512  # fp32 rows of 2 KiB: 512 rows per 1 MiB checksum chunk, 4 chunks


def _weights() -> torch.Tensor:
    return torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(5)) * 0.02


def test_a_compressed_save_uploads_less_and_loads_bitwise(s3_server, s3_url):
    proxy = FaultProxy(s3_server.endpoint)
    try:
        weights = _weights()
        uploaded = {}
        for name, compression in (("raw", None), ("zstd", CODEC)):
            storage = S3Storage(f"{s3_url}/{name}", **s3_server.options(proxy.endpoint))
            proxy.reset_counts()
            bcp.save(storage, {"model": {"w": weights}}, compression=compression)
            uploaded[name] = proxy.received_body_bytes
            loaded = {"w": torch.zeros_like(weights)}
            bcp.load(storage, {"model": loaded})
            assert torch.equal(loaded["w"].view(torch.int32), weights.view(torch.int32))
        assert uploaded["zstd"] < uploaded["raw"] * 0.95, uploaded
    finally:
        proxy.close()


def test_a_slice_downloads_only_the_stored_bytes_of_the_chunks_that_cover_it(s3_server, s3_url):
    proxy = FaultProxy(s3_server.endpoint)
    try:
        storage = S3Storage(s3_url, **s3_server.options(proxy.endpoint))
        weights = _weights()
        bcp.save(storage, {"model": {"w": weights}}, compression=CODEC)
        where = open_checkpoint(storage).tensors["model/w"].shards[0].bytes
        assert len(where.stored.nbytes) == 4 and sum(where.stored.nbytes) < where.nbytes

        checkpoint = open_checkpoint(storage)  # the manifest read before counting: only data reads are counted
        proxy.reset_counts()
        rows = checkpoint.read("model/w", (slice(600, 700), ...))  # inside chunk 1
        assert torch.equal(rows.view(torch.int32), weights[600:700].view(torch.int32))
        assert (proxy.requests["GET"], proxy.get_body_bytes) == (1, where.stored.nbytes[1]), proxy.requests

        proxy.reset_counts()
        rows = checkpoint.read("model/w", (slice(1000, 1100), ...))  # across chunks 1 and 2: one ranged GET
        assert torch.equal(rows.view(torch.int32), weights[1000:1100].view(torch.int32))
        assert (proxy.requests["GET"], proxy.get_body_bytes) == (1, where.stored.nbytes[1] + where.stored.nbytes[2])

        proxy.reset_counts()
        assert torch.equal(read_tensor(storage, "model/w", (slice(1800, 1801), ...)), weights[1800:1801])
        assert proxy.get_body_bytes < where.stored.nbytes[3] + 64 * 1024  # the last chunk and the metadata
    finally:
        proxy.close()

