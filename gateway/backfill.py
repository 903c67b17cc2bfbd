"""Take back what agents kept through an outage and write it to Prometheus's remote-write receiver(s).

For each agent session a task asks for the backlog on a BACKFILL stream (raven/protocol/backfill.py) every
``poll_interval``, and while there is one, batch after batch: each stream acknowledges the batch before it. A
batch is decoded, checked and turned into remote-write requests in the catch-up's worker process
(gateway/catchupworker.py, gateway/catchupbuild.py: only nodes of the session's own pool at ports with a job;
pages within ``max_page`` that parse; samples within ``max_age`` and ``max_future`` of now; the labels the scrape
configuration gives the target). ``up`` and the scrape_* series are not written: the live scrapes' ``up == 0``
stays what happened. Every receiver gets every request (gateway/rwclient.py: retries with backoff, a 400 split
down to the scrape and then dropped and counted); only then is the batch acknowledged. The tunnel never waits on a
receiver: the stream is read whole first, and a session with a batch in writing is simply not asked again until
it is written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.catchupbuild import BuildSettings
from gateway.catchupworker import CatchupWorker, Step, WorkerLost
from gateway.registry import AgentSession, Registry
from gateway.rwclient import Receivers
from raven.config.backfill import GatewayBackfill
from raven.lograte import RateLimitedLog
from raven.protocol import backfill as bf
from raven.protocol import wire
from raven.protocol.stream import StreamReset

log = logging.getLogger("raven.gateway.backfill")

HEAD_TIMEOUT = 30.0


def _cancelling() -> bool:
    """Whether the current task is being cancelled (rather than a future it awaited cancelled under it)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


@dataclass(slots=True)
class Backlog:
    """What a pool's agent last said it holds (the HEAD of a backfill stream)."""

    bytes: int = 0
    scrapes: int = 0
    oldest_ms: int = 0
    at: float = field(default_factory=time.time)

    @property
    def minutes(self) -> float:
        return max(0.0, (self.at * 1000 - self.oldest_ms) / 60_000) if self.scrapes and self.oldest_ms else 0.0


class BackfillPuller:
    """One task per agent session; the service starts it when the session starts and cancels it at its end."""

    def __init__(self, cfg: GatewayBackfill, registry: Registry, receivers: Receivers, worker: CatchupWorker,
                 on_dropped: Callable[[str, int], None], on_written: Callable[[int], None],
                 on_received: Callable[[int], None], on_backlog: Callable[[str, Backlog], None]) -> None:
        self.cfg = cfg
        self.settings = BuildSettings.of(cfg)
        self.registry = registry
        self.receivers = receivers
        self.worker = worker
        self.on_dropped = on_dropped
        self.on_written = on_written
        self.on_received = on_received
        self.on_backlog = on_backlog
        self.backlogs: dict[str, Backlog] = {}  # pool -> the latest an agent of it said
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._log = RateLimitedLog(log)

    def pools_of(self, s: AgentSession, nodes: list[str]) -> dict[str, str]:
        """``nodes`` of the session's own pools -> their pool."""
        known = self.registry.nodes
        return {node: entry.pool for node in nodes
                if (entry := known.get(node)) is not None and entry.pool in s.pools}

    async def run(self, s: AgentSession) -> None:
        ack = 0
        await asyncio.sleep(min(2.0, self.cfg.poll_interval))  # its registration first
        while s.session.core.usable:
            try:
                got = await self._one(s, ack)
            except (StreamReset, TimeoutError, bf.BackfillError) as exc:
                why = exc.reason if isinstance(exc, StreamReset) else str(exc) or "timed out"
                self._log.info(s.agent, "backfill", "backfill from agent %s (pools %s) failed: %s", s.agent,
                               ",".join(sorted(s.pools)), why)
                got = None
            except WorkerLost as exc:
                self._log.warning(s.agent, "backfill-worker", "backfill from agent %s (pools %s) not written: %s",
                                  s.agent, ",".join(sorted(s.pools)), exc)
                got = None
            except (Exception, asyncio.CancelledError) as exc:  # never an end without a word: poll on
                if isinstance(exc, asyncio.CancelledError) and _cancelling():
                    raise  # this task's own cancellation (the session ended)
                self._log.log(logging.ERROR, s.agent, "backfill-error", "backfill from agent %s (pools %s) not "
                              "written: unexpected %s: %s; the batch is asked for again", s.agent,
                              ",".join(sorted(s.pools)), type(exc).__name__, exc)
                got = None
            if got is None:
                await asyncio.sleep(self.cfg.poll_interval)
            else:
                ack = got

    async def _one(self, s: AgentSession, ack: int) -> int | None:
        """Ask once: the new acknowledgement when a batch was written, None when there was nothing to take."""
        stream = s.session.open_stream(wire.Open(0, wire.StreamKind.BACKFILL, "", 0, "", bf.ack_target(ack),
                                                 fin=True))
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                head = await stream.head()
            self._note(s, head.headers)
            if head.status != 200:
                return None
            chunks: list[bytes] = []
            size = 0
            async with asyncio.timeout(self.cfg.timeout + self.cfg.max_batch / 65536):
                while chunk := await stream.read():
                    size += len(chunk)
                    if size > self.cfg.max_batch:
                        raise bf.BackfillError(f"backfill body over {self.cfg.max_batch} bytes")
                    chunks.append(bytes(chunk))
        finally:
            stream.close()
        async with self._slots:  # so the worker holds at most `concurrency` batches
            step = await self._write(s, chunks)
        for reason, n in step.dropped.items():
            self.on_dropped(reason, n)
        if step.dropped:
            self._log.warning(s.agent, "backfill-dropped", "backfill from agent %s (pools %s): dropped %s",
                              s.agent, ",".join(sorted(s.pools)),
                              ", ".join(f"{n} ({r})" for r, n in sorted(step.dropped.items())))
        return step.last_seq or ack

    async def _write(self, s: AgentSession, chunks: list[bytes]) -> Step:
        """The batch (its body's ``chunks``, taken) decoded, checked and built in the worker, and written: the
        last step."""
        batch = self.worker.batch()
        body = b"".join(chunks)
        chunks.clear()
        try:
            got = await batch.decode(body, self.cfg.max_page, self.cfg.max_batch)
            del body  # the worker has it
            self.on_received(got.scrapes)
            step = await batch.build(self.settings, self.pools_of(s, got.nodes), int(time.time() * 1000))
            while (req := step.request) is not None:
                if self.cfg.cpu_share < 1:  # the worker's share of a core: live scrapes need the rest
                    await asyncio.sleep(step.cpu * (1 / self.cfg.cpu_share - 1))
                refused = await self.receivers.write(req.body, req.parts)
                if refused:
                    self.on_dropped("refused", refused)
                self.on_written(len(req.parts) - refused)
                step = await batch.next()
            return step
        finally:
            batch.close()

    def _note(self, s: AgentSession, headers: wire.Headers) -> None:
        got = dict(headers)
        try:
            b = Backlog(int(got.get(bf.BACKLOG_HEADERS[0], 0)), int(got.get(bf.BACKLOG_HEADERS[1], 0)),
                        int(got.get(bf.BACKLOG_HEADERS[2], 0)))
        except ValueError:
            return
        for pool in s.pools:
            self.backlogs[pool] = b
            self.on_backlog(pool, b)


class BackfillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.received = Counter("raven_gateway_backfill_received", "Kept scrapes received from agents", registry=r)
        self.written = Counter("raven_gateway_backfill_written", "Kept scrapes every receiver acknowledged",
                               registry=r)
        self.dropped = Counter("raven_gateway_backfill_dropped", "Kept scrapes not written, by reason (node: not of "
                               "the session's pool; port: no job; future, too-old: timestamp; bad-page: does not "
                               "decompress or parse; refused: a receiver's 400)", ["reason"], registry=r)
        self.requests = Counter("raven_gateway_backfill_requests", "Remote-write requests by HTTP status (0: no "
                                "answer)", ["code"], registry=r)
        self.backlog_bytes = Gauge("raven_gateway_backfill_backlog_bytes", "Bytes an agent of the pool last said it "
                                   "keeps", ["pool"], registry=r)
        self.backlog_minutes = Gauge("raven_gateway_backfill_backlog_minutes", "Minutes since the oldest scrape an "
                                     "agent of the pool last said it keeps", ["pool"], registry=r)


class Backfill:
    """The gateway's backfill, wired: one puller task per agent session, the receivers, the metrics.

    gateway/tunnel.py runs :meth:`session` beside each session; the service calls :meth:`start` (which says why
    backfill is off when it is) and :meth:`stop`.
    """

    def __init__(self, cfg: GatewayBackfill, registry: Registry, metrics_registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.metrics = BackfillMetrics(metrics_registry)
        m = self.metrics
        self.receivers = Receivers(cfg, on_request=lambda url, code: m.requests.labels(str(code)).inc())
        self.worker = CatchupWorker(cfg.build_timeout)  # started at the first batch
        self.puller = BackfillPuller(cfg, registry, self.receivers, self.worker,
                                     on_dropped=lambda reason, n: m.dropped.labels(reason).inc(n),
                                     on_written=m.written.inc, on_received=m.received.inc, on_backlog=self._backlog)
        self.off_reason = "" if cfg.enabled and cfg.receivers else (
            "backfill.enabled is false" if not cfg.enabled else "no receivers configured (backfill.receivers)")

    def _backlog(self, pool: str, b: Backlog) -> None:
        self.metrics.backlog_bytes.labels(pool).set(b.bytes)
        self.metrics.backlog_minutes.labels(pool).set(round(b.minutes, 2))

    def status(self) -> dict[str, dict[str, float]]:
        """Each pool's backlog as its agents last said it (the status page and `raven status`)."""
        return {pool: {"bytes": b.bytes, "scrapes": b.scrapes, "minutes": round(b.minutes, 1)}
                for pool, b in sorted(self.puller.backlogs.items())}

    async def start(self) -> None:
        if self.cfg.switch_interval is not None:
            log.warning("backfill.switch_interval is deprecated and ignored: the catch-up's parsing runs in a worker "
                        "process, and the interpreter's switch interval is left alone (docs/backfill.md)")
        if self.off_reason:
            log.info("backfill is off: %s", self.off_reason)
            return
        problems = await self.receivers.probe()
        if len(problems) == len(self.cfg.receivers):
            not_enabled = all("404" in p for p in problems)
            if not_enabled:
                self.off_reason = "no receiver takes remote writes: " + "; ".join(problems)
                log.warning("backfill is off: %s", self.off_reason)
                return
        for p in problems:
            log.warning("backfill: receiver %s; kept scrapes wait at the agents until it answers", p)
        log.info("backfill on: kept scrapes go to %s", ", ".join(r.url for r in self.cfg.receivers))

    @property
    def on(self) -> bool:
        """Backfill runs (enabled, with receivers, and they take remote writes): sessions get a puller."""
        return not self.off_reason

    async def session(self, s: AgentSession) -> None:
        if not self.off_reason:
            await self.puller.run(s)

    async def stop(self) -> None:
        await self.worker.close()
        await self.receivers.close()
