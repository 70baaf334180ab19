"""A compressed load from an object store decodes a GET's chunks as they arrive: the first tensors
of a reply are decoded while a proxy in front of a real SeaweedFS holds the reply's second half back,
and a reply cut off halfway, after some of its tensors were decoded, is read again and loads bitwise."""

from __future__ import annotations

import threading
from typing import Any

import bcp
import torch
from bcp.engine.verification import ChunkDecoder
from bcp.storage import S3Storage
from s3_fault_proxy import FaultProxy

TENSORS, ROWS, COLUMNS = 8, 256, 1024  # fp32 tensors of 1 MiB, saved in one file of about 7 MiB stored
LARGE = 1 << 20  # replies from this size on are held or cut halfway: the data file's, not the metadata's
HOLD_S = 20.0  # at most this long a reply's second half is held: without streamed decoding the test fails, not hangs


class HalfwayProxy(FaultProxy):
    """Sends the first half of each large GET reply, then waits for ``resume`` (at most ``HOLD_S``;
    ``resumed`` notes whether it came in time) before sending the rest or, for the first ``cuts``
    such replies, resetting the connection."""

    def __init__(self, upstream: str, cuts: int = 0) -> None:
        self.resume = threading.Event()
        self.resumed: list[bool] = []
        self.cuts = cuts
        super().__init__(upstream)

    def _handler(self) -> type:
        proxy = self

        class Halfway(super()._handler()):
            def _reply(self, status: int, headers: list[tuple[str, str]], payload: bytes) -> None:
                if self.command != "GET" or len(payload) < LARGE:
                    return super()._reply(status, headers, payload)
                wfile, self.wfile = self.wfile, _Halfway(self, self.wfile, proxy)
                try:
                    super()._reply(status, headers, payload)
                finally:
                    self.wfile = wfile

        return Halfway


class _Halfway:
    """A reply's writes, a large one sent half by half as ``HalfwayProxy`` says."""

    def __init__(self, handler: Any, wfile: Any, proxy: HalfwayProxy) -> None:
        self.handler, self.wfile, self.proxy = handler, wfile, proxy

    def write(self, data: bytes) -> int:
        if len(data) < LARGE:
            return self.wfile.write(data)
        half = len(data) // 2
        self.wfile.write(data[:half])
        self.wfile.flush()
        resumed = self.proxy.resume.wait(HOLD_S)
        with self.proxy.lock:
            cut = self.proxy.cuts > 0
            self.proxy.cuts -= cut
        if cut:
            self.handler._reset()
            raise ConnectionAbortedError("reply cut off halfway")
        self.proxy.resumed.append(resumed)
        return self.wfile.write(data[half:])

    def flush(self) -> None:
        self.wfile.flush()


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return {f"w{i}": torch.randn(ROWS, COLUMNS, generator=generator) * 0.02 for i in range(TENSORS)}


def _load_through(proxy: HalfwayProxy, s3_server: Any, url: str, state: dict[str, torch.Tensor]) -> S3Storage:
    bcp.save(S3Storage(url, **s3_server.options()), {"model": state}, compression="zstd", io_threads=1)
    storage = S3Storage(url, **s3_server.options(proxy.endpoint))
    loaded = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    bcp.load(storage, {"model": loaded}, io_threads=1)
    for name, tensor in state.items():
        assert torch.equal(loaded[name].view(torch.int32), tensor.view(torch.int32)), name
    return storage


def _resumed_by_decoding(proxy: HalfwayProxy, monkeypatch: Any) -> None:
    """The real decoder, whose first call lets the proxy go on."""
    decode = ChunkDecoder.decode

    def resuming(self, *args, **kwargs):
        proxy.resume.set()
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(ChunkDecoder, "decode", resuming)


def test_a_compressed_load_decodes_the_first_tensors_of_a_get_while_its_rest_is_held_back(s3_server, s3_url,
                                                                                          monkeypatch):
    proxy = HalfwayProxy(s3_server.endpoint)
    _resumed_by_decoding(proxy, monkeypatch)
    try:
        _load_through(proxy, s3_server, s3_url, _state())
    finally:
        proxy.close()
    assert proxy.resumed == [True], proxy.resumed  # one large GET, its rest sent once a tensor was decoded


def test_a_get_cut_off_after_some_of_its_tensors_were_decoded_is_read_again_bitwise(s3_server, s3_url,
                                                                                     monkeypatch):
    proxy = HalfwayProxy(s3_server.endpoint, cuts=1)
    _resumed_by_decoding(proxy, monkeypatch)
    try:
        storage = _load_through(proxy, s3_server, s3_url, _state())
    finally:
        proxy.close()
    assert proxy.cuts == 0 and proxy.resumed == [True], (proxy.cuts, proxy.resumed)
    assert sum(storage.stats.snapshot()["retries"].values()) == 1, storage.stats.snapshot()
