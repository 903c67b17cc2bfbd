"""No string an agent chose goes into an answer's header unchecked (issue 29 item 4), without sockets.

The handshake refuses an agent certificate whose name breaks the node-name rule (tests/integration/
test_peer_strings.py attacks that with real certificates); the relay does not rely on it alone: the agent's name
goes into ``X-Raven-Agent`` through :func:`gateway.request.header_safe`, so a CR LF can neither inject a header
nor make aiohttp fail the answer with a 500."""

from __future__ import annotations

import asyncio

from raven.protocol import wire
from tests.unit.test_proxy_write_stall import PAGE, Writer, exchange, page_stream, proxy


async def test_the_agent_header_cannot_carry_cr_lf() -> None:
    p, writer, (stream, _) = proxy(5), Writer(stall_at_eof=False), page_stream()
    ex, _ = exchange(writer)
    ex.agent = "evil\r\nX-Injected: yes\x1b[2J"
    head = wire.Head(1, 200, "OK", (("Content-Length", str(len(PAGE))),))
    await asyncio.wait_for(p._relay_response(ex, stream, head), 10)
    assert ex.code == "200" and writer.written[-2:] == [PAGE, b"<eof>"]
    assert writer.headers["X-Raven-Agent"] == "evil??X-Injected: yes?[2J"
    assert "X-Injected" not in writer.headers
