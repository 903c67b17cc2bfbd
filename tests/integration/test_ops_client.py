"""The one reader of ops endpoints (raven/ops/client.py), used by ``raven status`` / ``hosts`` / ``dns check`` and
``raven check``: a server that never stops sending is cut off at the cap with a sentence, not read into memory
until the deadline; the gateway's reading of an agent's clock takes only a date (tests/unit has none of this: real
sockets)."""

from __future__ import annotations

import asyncio
import email.utils
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from gateway.tunnel import agent_clock_offset
from raven.ops import client


@pytest.fixture
async def endless() -> AsyncIterator[str]:
    """An ops listener whose /status is an endless JSON string."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b'{"replica": "')
        chunk = b"x" * (1 << 20)
        try:
            while True:
                await resp.write(chunk)
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp

    async def big(request: web.Request) -> web.StreamResponse:
        """8 MiB of JSON in 1 MiB writes: a fleet-sized /status arrives in many pieces."""
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b'{"replica": "')
        for _ in range(8):
            await resp.write(b"x" * (1 << 20))
            await asyncio.sleep(0.01)
        await resp.write(b'"}')
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/status", handler)
    app.router.add_get("/big", big)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_a_body_beyond_the_cap_is_refused(endless: str) -> None:
    with pytest.raises(client.OpsReadError, match=r"sent more than 4 MiB"):
        await client.get_json(endless, "/status", timeout=30, max_bytes=4 << 20)


async def test_a_body_in_many_pieces_is_read_whole(endless: str) -> None:
    """Found here: the reader took what ``read(cap)`` returned first, a part of a large /status, then said "not
    JSON"."""
    doc = await client.get_json(endless, "/big", timeout=30)
    assert len(doc["replica"]) == 8 << 20


async def test_raven_status_stops_at_the_cap_not_the_deadline(endless: str) -> None:
    """``raven status`` read the whole body before (no cap): now it stops at 64 MiB, well before --timeout."""
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "raven.cli", "status", "--gateway", endless, "--timeout", "120",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 150)
    assert proc.returncode == 1 and b"sent more than 64 MiB" in err and b"Traceback" not in err, err
    assert time.monotonic() - start < 100


def test_the_gateway_reads_only_a_date_from_an_agent() -> None:
    now = time.time()
    assert agent_clock_offset(email.utils.formatdate(now + 90, usegmt=True), now) == pytest.approx(90, abs=1.1)
    for hostile in (None, "", "yesterday", "Tue, 99 Foo 2026 99:99:99 GMT", "x" * 10_000,
                    email.utils.formatdate(now + 20 * 365 * 86400, usegmt=True)):
        assert agent_clock_offset(hostile, now) is None, hostile
