"""The agent's side of a backfill stream (agent/backfillserve.py) over two in-memory sessions: an empty backlog,
a batch and its acknowledgement, one stream at a time, the rate cap, and a malformed OPEN."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from prometheus_client import CollectorRegistry

from agent.backfillserve import BackfillServer
from agent.backlog import Backlog
from agent.outage import BackfillMetrics
from raven.protocol import backfill as bf
from raven.protocol import wire
from raven.protocol.stream import StreamReset
from raven.transport.tunnel import Tunnel
from tests.support.memsession import pair

T0 = 1_800_000_000_000


async def _ask(gw: Tunnel, target: str) -> tuple[int, dict[str, str], list[bf.Entry]]:
    stream = gw.open_stream(wire.Open(0, wire.StreamKind.BACKFILL, "", 0, "", target, fin=True))
    head = await stream.head()
    dec = bf.Decoder()
    entries: list[bf.Entry] = []
    while chunk := await stream.read():
        entries += dec.feed(chunk)
    dec.finish()
    stream.close()
    return head.status, dict(head.headers), entries


async def _bed(backlog: Backlog, rate: float = 1e9) -> tuple[Tunnel, Tunnel, list[asyncio.Task[None]]]:
    server = BackfillServer(backlog, BackfillMetrics(CollectorRegistry()), rate, batch_bytes=1 << 20)
    return await pair(server.on_open)


async def _close(gw: Tunnel, ag: Tunnel, tasks: list[asyncio.Task[None]]) -> None:
    await gw.close("done")
    await ag.close("done")
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_batch_then_its_acknowledgement_then_nothing() -> None:
    backlog = Backlog()
    for i in range(3):
        backlog.add("n1", 9400, T0 + i * 1000, f"g {i}\n".encode())
    gw, ag, tasks = await _bed(backlog)
    try:
        first = await _ask(gw, bf.ack_target(0))
        # Not acknowledged (the gateway could not write it): the same batch again.
        status, headers, entries = await _ask(gw, bf.ack_target(0))
        assert entries == first[2]
        assert status == 200 and headers["backlog-scrapes"] == "3" and int(headers["backlog-oldest-ms"]) == T0
        seqs = [e.seq for e in entries if isinstance(e, bf.Scrape)]
        assert seqs == [1, 2, 3]
        status, headers, entries = await _ask(gw, bf.ack_target(max(seqs)))
        assert (status, headers["backlog-scrapes"], entries) == (204, "0", [])
        assert backlog.scrapes == 0
    finally:
        await _close(gw, ag, tasks)


async def test_one_stream_at_a_time_under_the_rate_cap() -> None:
    backlog = Backlog()
    backlog.add("n1", 9400, T0, os.urandom(300_000))  # a key that does not compress: ~300 kB to send
    backlog.add("n1", 9400, T0 + 1000, os.urandom(10))
    gw, ag, tasks = await _bed(backlog, rate=600_000)
    try:
        start = time.monotonic()
        first = asyncio.get_running_loop().create_task(_ask(gw, bf.ack_target(0)))
        await asyncio.sleep(0.05)
        status, _, _ = await _ask(gw, bf.ack_target(0))
        assert status == 429  # another replica's stream is being served
        status, _, entries = await first
        assert status == 200 and len(entries) == 3
        assert time.monotonic() - start >= 0.35  # 300 kB at 600 kB/s, less the first 64 KiB piece
    finally:
        await _close(gw, ag, tasks)


@pytest.mark.parametrize("target", ["/backfill?ack=x", "/metrics", "/backfill?ack=1&more=2"])
async def test_a_malformed_open_is_reset_and_the_session_lives_on(target: str) -> None:
    backlog = Backlog()
    gw, ag, tasks = await _bed(backlog)
    try:
        with pytest.raises(StreamReset, match="not /backfill"):
            await _ask(gw, target)
        assert (await _ask(gw, bf.ack_target(0)))[0] == 204
    finally:
        await _close(gw, ag, tasks)
