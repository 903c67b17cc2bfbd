"""Serve the gateway's backfill streams (raven/protocol/backfill.py): drop what it acknowledges, send one batch.

One stream at a time for the whole agent (a second replica asking meanwhile hears 429 and asks later), so that
each kept scrape is written once. The batch leaves under a rate cap (``rate`` bytes a second, a token bucket on
the loop's clock) and, being a stream that soon passes the outbox's bulk mark, behind live scrapes (one turn in
five, raven/protocol/outbox.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from agent.backlog import Backlog
from agent.outage import BackfillMetrics
from raven.protocol import backfill as bf
from raven.protocol import wire
from raven.protocol.stream import StreamReset
from raven.transport.stream import Stream

log = logging.getLogger("raven.agent.backfill")

CHUNK = 64 * 1024


class BackfillServer:
    def __init__(self, backlog: Backlog, metrics: BackfillMetrics, rate: float, batch_bytes: int) -> None:
        self.backlog = backlog
        self.metrics = metrics
        self.rate = rate  # bytes a second on the uplink
        self.batch_bytes = batch_bytes
        self.busy = False
        self.tasks: set[asyncio.Task[None]] = set()

    def on_open(self, stream: Stream) -> None:
        try:
            ack = bf.parse_ack(stream.open.target)
        except bf.BackfillError as exc:
            stream.reset(wire.ResetCode.PROTOCOL, str(exc))
            return
        self.backlog.hold(time.time())  # the age cap holds while nothing new is added too
        acked = self.backlog.ack(ack)
        if acked:
            self.metrics.acked.inc(acked)
            self._gauges()
        if self.busy:
            stream.send_head(429, "Another replica is taking the backlog", self._headers(), fin=True)
            stream.close()
            return
        batch = self.backlog.batch(self.batch_bytes)
        if not batch:
            stream.send_head(204, "No backlog", self._headers(), fin=True)
            stream.close()
            return
        self.busy = True
        task = asyncio.get_running_loop().create_task(self._send(stream, batch))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.busy = False
        if not task.cancelled() and task.exception() is not None:
            log.error("backfill stream failed: %r", task.exception())

    def _headers(self) -> wire.Headers:
        b = self.backlog
        return tuple(zip(bf.BACKLOG_HEADERS, (str(b.bytes), str(b.scrapes), str(b.oldest_ms)), strict=True))

    def _gauges(self) -> None:
        self.metrics.backlog_bytes.set(self.backlog.bytes)
        self.metrics.backlog_scrapes.set(self.backlog.scrapes)

    async def _send(self, stream: Stream, batch: list[bf.Entry]) -> None:
        loop = asyncio.get_running_loop()
        free_at = loop.time()
        body = b"".join(bf.encode(e) for e in batch)
        scrapes = sum(isinstance(e, bf.Scrape) for e in batch)
        try:
            stream.send_head(200, "OK", self._headers())
            view = memoryview(body)
            for at in range(0, len(view), CHUNK):
                piece = view[at:at + CHUNK]
                # The cap: each piece leaves once the pieces before it have had their share of the rate.
                now = loop.time()
                if free_at > now:
                    await asyncio.sleep(free_at - now)
                free_at = max(free_at, now) + len(piece) / self.rate
                await stream.write(piece, end=at + CHUNK >= len(view))
            self.metrics.sent.inc(scrapes)
        except StreamReset as exc:
            log.info("backfill stream ended by the gateway: %s", exc.reason)
        finally:
            stream.close()

