"""A page that is all there leaves the gateway in one write on the lean front end (gateway/proxy.py with
raven/http/h1server.py), without sockets: head and body together, and when the node sent no Content-Length
(the page is chunked) its last chunk too, since its FIN came with it; a page still arriving is relayed chunk
by chunk, and an answer to HEAD carries no body bytes."""

from __future__ import annotations

import asyncio
import time

from gateway.admission import Exchange
from gateway.request import Target
from raven.deadline import Deadline
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.http.h1 import RequestReader
from raven.http.h1server import LeanCall, LeanServer
from raven.protocol import wire
from tests.unit.test_proxy_write_stall import PAGE, page_stream, proxy


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


async def relay(method: str, chunks: list[bytes], headers: tuple[tuple[str, str], ...] = ()) -> list[bytes]:
    writes, ex = await _relay(method, chunks, headers)
    assert ex.code == "200", ex.reason
    return writes


async def relay_any(method: str, chunks: list[bytes], headers: tuple[tuple[str, str], ...] = ()) -> list[bytes]:
    """What the client was sent, however the relay ended."""
    return (await _relay(method, chunks, headers))[0]


async def _relay(method: str, chunks: list[bytes], headers: tuple[tuple[str, str], ...]) -> tuple[list[bytes],
                                                                                                   Exchange]:
    async def nothing(call: LeanCall) -> None:
        pass

    server = LeanServer(nothing, ConnectionGuard("front", GuardLimits()), 16384, 65536, lambda c, w: None)
    proto = server()
    transport = Transport()
    proto.connection_made(transport)
    reader = RequestReader(16384, 65536)
    reader.feed(f"{method} /metrics HTTP/1.1\r\nHost: edge-1:9400\r\n\r\n".encode())
    call = LeanCall(proto, reader.ready.popleft())
    ex = Exchange(call, time.monotonic())
    ex.target = Target("edge-1", 9400, "/metrics", wire.StreamKind.HTTP)
    ex.node, ex.pool, ex.agent, ex.deadline = "edge-1", "pool-a", "agent-1", Deadline.after(30)
    stream, _ = page_stream(chunks)
    await proxy(5)._relay_response(ex, stream, wire.Head(1, 200, "OK", headers))
    return transport.writes, ex


async def test_a_page_that_is_all_there_leaves_in_one_write() -> None:
    (write,) = await relay("GET", [PAGE, b""])  # no Content-Length from the node, its FIN already here
    head, _, body = write.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in head
    assert b"X-Raven-Agent: agent-1" in head and body == b"%x\r\n%s\r\n0\r\n\r\n" % (len(PAGE), PAGE)
    (write,) = await relay("GET", [PAGE, b""], (("Content-Length", str(len(PAGE))),))
    assert b"Content-Length: %d\r\n" % len(PAGE) in write and write.endswith(b"\r\n\r\n" + PAGE)


async def test_a_page_still_arriving_is_chunked_and_a_head_answer_has_no_body() -> None:
    writes = await relay("GET", [PAGE, PAGE, b""])
    assert b"Transfer-Encoding: chunked" in writes[0] and writes[0].endswith(b"\r\n" + PAGE + b"\r\n")
    assert writes[1:] == [b"%x\r\n%s\r\n" % (len(PAGE), PAGE), b"0\r\n\r\n"]
    (write,) = await relay("HEAD", [b""], (("Content-Length", str(len(PAGE))),))
    assert write.endswith(b"Content-Length: %d\r\n\r\n" % len(PAGE))


async def test_bytes_past_the_content_length_never_reach_the_client() -> None:
    # Found by review: a (hostile) agent's body longer than its Content-Length went out whole before the abort;
    # the client would read the extra bytes as the next answer on its keep-alive connection.
    forged = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nforge"
    writes = await relay_any("GET", [PAGE + forged, b""], (("Content-Length", str(len(PAGE))),))
    sent = b"".join(writes)
    assert sent.endswith(b"\r\n\r\n" + PAGE) and forged not in sent
