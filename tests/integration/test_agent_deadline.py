"""The agent spends the gateway's deadline once: the wait for a node's slot and the request share one budget.

A node answers each request only after ``HOLD`` seconds and the agent has one upstream slot for it. Two
streams arrive together with a deadline of ``DEADLINE`` seconds: the first takes the slot, the second waits
``HOLD`` for it and would then wait ``HOLD`` again for its answer. ``HOLD`` < ``DEADLINE`` < 2 * ``HOLD``:
with a fresh timer per wait the second stream would answer after about 2 * ``HOLD``; with one deadline it is
reset (TIMEOUT) within ``DEADLINE``. The deadline is either the agent's own ``request_timeout`` or the one the
gateway states in OPEN (the tunnel's contract, ``deadline_ms``), shorter than the agent's own: the same value is
spent either way (raven/deadline.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from agent.checks import Policy
from agent.forwarder import Forwarder
from raven.ops.metrics import AgentMetrics
from raven.protocol import OpenFields, wire
from raven.protocol.stream import StreamReset
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.memsession import pair

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

HOLD = 0.8
DEADLINE = 1.2


WRITERS: set[asyncio.StreamWriter] = set()


async def _slow_node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    WRITERS.add(writer)
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(HOLD)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        WRITERS.discard(writer)
        writer.close()


@pytest.fixture
async def node() -> AsyncIterator[tuple[str, int]]:
    host = HOSTS[9]
    port = pick_node_port([host])
    server = await asyncio.start_server(_slow_node, host, port)
    try:
        yield host, port
    finally:
        server.close()
        for writer in list(WRITERS):
            writer.transport.abort()
        async with asyncio.timeout(5):
            await server.wait_closed()


async def _outcome(stream: object, started: float) -> tuple[str, float]:
    """How the stream ended at the gateway's side (a status or the reset's code) and when."""
    loop = asyncio.get_running_loop()
    try:
        head = await stream.head()  # type: ignore[attr-defined]
        while await stream.read():  # type: ignore[attr-defined]
            pass
        return str(head.status), loop.time() - started
    except StreamReset as exc:
        return wire.ResetCode(exc.code).name, loop.time() - started


@pytest.mark.parametrize("stated", [False, True], ids=["agents-own", "stated-in-open"])
async def test_slot_wait_and_request_share_one_deadline(node: tuple[str, int], stated: bool) -> None:
    host, port = node
    # The budget: the agent's own bound, or the gateway's deadline in OPEN under an agent bound of a minute.
    policy = Policy(frozenset([port]), frozenset(["GET"]), False, 60.0 if stated else DEADLINE)
    fields = OpenFields(deadline_ms=int(DEADLINE * 1000), client="c1") if stated else None
    forwarder = Forwarder(lambda: {"edge-d-1": host}, policy, AgentMetrics(), connect_timeout=5,
                          connections_per_node=1, draining=lambda: False, client_share=1.0)
    gw, ag, tasks = await pair(forwarder.on_open)
    try:
        opened = wire.Open(0, wire.StreamKind.HTTP, "edge-d-1", port, "GET", "/metrics",
                           (("host", f"edge-d-1:{port}"),), True, fields)
        started = asyncio.get_running_loop().time()
        first, second = gw.open_stream(opened), gw.open_stream(opened)
        async with asyncio.timeout(3 * HOLD + 2):
            (code1, took1), (code2, took2) = await asyncio.gather(_outcome(first, started), _outcome(second, started))
        assert code1 == "200" and took1 < DEADLINE, (code1, took1)
        # Slot wait (~HOLD) + request (~HOLD) exceed the deadline: the agent gives up at the deadline, not after.
        assert code2 == wire.ResetCode.TIMEOUT.name, (code2, took2)
        assert took2 < DEADLINE + 0.25, f"answered after {took2:.2f}s for a {DEADLINE}s deadline"
    finally:
        await forwarder.close()
        for session in (gw, ag):
            await session.close("test over")
        await asyncio.gather(*tasks, return_exceptions=True)
