"""The relay's write-stall deadline covers the end of a response too (gateway/proxy.py), without sockets.

aiohttp's ``write_eof`` drains whatever earlier writes left in the transport's buffer: a client that stops
reading just before the end would hold the stream, its node's slot and the handler for ever. The end waits at
most ``write_stall_timeout``, like every other write, and the client is then treated as stalled."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from unittest import mock

from aiohttp.test_utils import make_mocked_request

from gateway.admission import Exchange
from gateway.aiocall import AiohttpCall
from gateway.proxy import Proxy
from gateway.registry import Registry
from gateway.request import Target
from raven.config.gateway import GatewayFront
from raven.deadline import Deadline
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.ops.metrics import GatewayMetrics
from raven.protocol import wire
from raven.transport.tunnel import Stream
from tests.support import memstream

PAGE = b"DCGM_FI_DEV_GPU_TEMP 41\n" * 100


def page_stream(chunks: list[bytes] | None = None) -> tuple[Stream, memstream.RecordingLink]:
    """A response stream whose page (HEAD, DATA and FIN) is all there, as it usually is (the real Stream: compiled
    code refuses a stand-in)."""
    stream, link = memstream.stream()
    memstream.deliver(stream, [PAGE, b""] if chunks is None else chunks)
    return stream, link


class Writer:
    """aiohttp's payload writer where the client took every byte but the end: ``write_eof`` never returns."""

    def __init__(self, stall_at_eof: bool) -> None:
        self.stall_at_eof = stall_at_eof
        self.written: list[bytes] = []
        self.headers: dict[str, str] = {}
        self.buffer_size = 0
        self.output_size = 0
        self.length: int | None = None
        self.chunked = False

    def enable_chunking(self) -> None:
        self.chunked = True

    def enable_compression(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the relay never compresses")

    async def write_headers(self, status_line: str, headers: Any) -> None:
        self.written.append(status_line.encode())
        self.headers = dict(headers)

    def send_headers(self) -> None:
        pass

    async def write(self, chunk: bytes, **kwargs: Any) -> None:
        self.written.append(bytes(chunk))

    async def write_eof(self, chunk: bytes = b"") -> None:
        if self.stall_at_eof:
            await asyncio.Event().wait()  # the final drain: the client does not read
        self.written.append(b"<eof>")

    async def drain(self) -> None:
        pass


def proxy(stall: float) -> Proxy:
    cfg = GatewayFront.model_validate({"listen": "127.0.0.1:1", "write_stall_timeout": stall})
    guard = ConnectionGuard("front", GuardLimits())
    return Proxy(cfg, Registry(), GatewayMetrics(), lambda: False, guard)


def exchange(writer: Writer) -> tuple[Exchange, mock.Mock]:
    transport = mock.Mock()
    transport.get_extra_info.return_value = None
    request = make_mocked_request("GET", "/metrics", headers={"Host": "edge-1:9400"}, writer=writer,
                                  transport=transport)
    ex = Exchange(AiohttpCall(request), time.monotonic())
    ex.target = Target("edge-1", 9400, "/metrics", wire.StreamKind.HTTP)
    ex.node, ex.pool, ex.agent = "edge-1", "pool-a", "agent-1"
    ex.deadline = Deadline.after(30)
    return ex, transport


async def test_a_client_that_stops_reading_before_the_end_is_given_up_on() -> None:
    p, writer, (stream, link) = proxy(0.2), Writer(stall_at_eof=True), page_stream()
    ex, transport = exchange(writer)
    head = wire.Head(1, 200, "OK", (("Content-Length", str(len(PAGE))),))
    # Without a deadline on the end this never returns; wait_for turns that into a failure, not a hang.
    await asyncio.wait_for(p._relay_response(ex, stream, head), 10)
    assert ex.code == "client-stalled" and not ex.observe
    assert [code for code, _ in link.resets] == [wire.ResetCode.CANCEL]  # the agent lets the node go
    transport.abort.assert_called_once()  # an RST: the response can never read as complete
    refused = p.metrics.registry.get_sample_value("raven_gateway_front_refused_total", {"reason": "write-stall"})
    assert refused == 1


async def test_a_client_that_reads_to_the_end_gets_its_page() -> None:
    p, writer, (stream, link) = proxy(0.2), Writer(stall_at_eof=False), page_stream()
    ex, transport = exchange(writer)
    head = wire.Head(1, 200, "OK", (("Content-Length", str(len(PAGE))),))
    await asyncio.wait_for(p._relay_response(ex, stream, head), 10)
    assert ex.code == "200" and ex.observe and ex.received == len(PAGE)
    assert writer.written[-2:] == [PAGE, b"<eof>"] and not link.resets
    transport.abort.assert_not_called()
