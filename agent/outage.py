"""Keep scraping through an outage: learn each target's cadence from the scrapes the agent relays, and while the
agent hears no gateway replica (agent/service.py says when), scrape each learned target itself and keep the pages.

:class:`Learner` watches every relayed GET answered 200 whose ``Accept`` names an exposition format (Prometheus,
vmagent and Alloy all send one): per (node, port, target) it keeps the path, the ``Accept`` header (less the
protobuf format: the gateway parses text), the timeout the gateway gave and the interval between one client's
scrapes (the least over the clients: an HA pair scrapes the same interval). A target never scraped is never
scraped here. :class:`OutageScraper` scrapes on the same phase (the last relayed scrape plus whole intervals), with
the agent's own checks (agent/checks.py: inventory address, allowed port) and its upstream pool, the page bounded
as ``max_page``; pages go to the backlog (agent/backlog.py). A node that does not answer leaves a hole. Of a pool's
agents, the one that relayed a target's latest scrape keeps scraping it (:meth:`Learner.owned`); the gateway
sends a node's scrapes through one agent of the pool (gateway/rendezvous.py), so a node is kept by one agent.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.backlog import Backlog
from agent.checks import Policy, check_open
from agent.upstream import UpstreamError, UpstreamPool
from raven.aio import cancel_and_wait
from raven.lograte import RateLimitedLog
from raven.protocol import wire
from raven.refusals import Refusal

log = logging.getLogger("raven.agent.outage")

MIN_INTERVAL = 0.5
MAX_INTERVAL = 900.0
GAPS = 8
MAX_TARGETS = 50_000  # learned targets; past it the least recently scraped is forgotten
DEFAULT_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
_EXPOSITION = ("text/plain", "openmetrics-text")
_PROTOBUF = "application/vnd.google.protobuf"


class BackfillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.kept = Counter("raven_agent_backfill_kept", "Scrapes the agent made and kept while it had no session",
                            registry=r)
        self.failed = Counter("raven_agent_backfill_scrape_failures", "Scrapes of the agent's own during an outage "
                              "that got no page (the node left a hole)", registry=r)
        self.sent = Counter("raven_agent_backfill_sent", "Kept scrapes sent to a gateway", registry=r)
        self.acked = Counter("raven_agent_backfill_acknowledged", "Kept scrapes the gateway wrote and acknowledged",
                             registry=r)
        self.dropped = Counter("raven_agent_backfill_dropped", "Kept scrapes dropped before they were written, by "
                               "reason (full: byte cap, age: age cap)", ["reason"], registry=r)
        self.backlog_bytes = Gauge("raven_agent_backfill_backlog_bytes", "Bytes the backlog holds", registry=r)
        self.backlog_scrapes = Gauge("raven_agent_backfill_backlog_scrapes", "Scrapes the backlog holds", registry=r)
        self.targets = Gauge("raven_agent_backfill_targets", "Targets whose cadence the agent has learned", registry=r)


@dataclass(slots=True)
class Target:
    node: str
    port: int
    path: str
    accept: str
    timeout: float
    interval: float = 0.0
    last: float = 0.0  # wall clock of the latest relayed scrape's arrival (any client)
    clients: dict[str, float] = field(default_factory=dict)  # client key -> its latest scrape
    gaps: list[float] = field(default_factory=list)  # the latest gaps between one client's scrapes

    @property
    def learned(self) -> bool:
        return self.interval > 0


def accept_of(headers: wire.Headers) -> str:
    """The request's Accept header if it names an exposition format, less protobuf; "" when it names none."""
    value = next((v for k, v in headers if k.lower() == "accept"), "")
    if not any(kind in value for kind in _EXPOSITION):
        return ""
    parts = [p.strip() for p in value.split(",") if _PROTOBUF not in p]
    return ",".join(p for p in parts if p) or DEFAULT_ACCEPT


class Learner:
    def __init__(self, max_targets: int = MAX_TARGETS) -> None:
        self.max_targets = max_targets
        self.targets: dict[tuple[str, int, str], Target] = {}
        self.latest = 0.0  # the latest relayed scrape of any target

    def observe(self, frame: wire.Open, timeout: float, client: str, now: float) -> None:
        """A relayed request that arrived at ``now`` (wall clock) was answered 200: learn from it when it was a
        scrape. The arrival, not the answer: a node's time to answer varies (a busy exporter, a pause on the path),
        and the gaps between answers with it; the least gap would be short of the interval by that much."""
        if frame.method != "GET" or frame.kind != wire.StreamKind.HTTP:
            return
        accept = accept_of(frame.headers)
        if not accept:
            return
        key = (frame.node, frame.port, frame.target)
        t = self.targets.pop(key, None)  # re-inserted last: the dict's order is least recently scraped first
        if t is None:
            if len(self.targets) >= self.max_targets:
                del self.targets[next(iter(self.targets))]
            t = Target(frame.node, frame.port, frame.target, accept, timeout)
        self.targets[key] = t
        t.accept, t.timeout = accept, timeout
        prev = t.clients.get(client)
        t.clients[client] = now
        if len(t.clients) > 8:  # clients that no longer scrape it
            del t.clients[min(t.clients, key=t.clients.__getitem__)]
        t.last = max(t.last, now)  # answers of an HA pair's scrapes may come in another order than they arrived
        self.latest = max(self.latest, now)
        if prev is None:
            return
        gap = now - prev
        if not MIN_INTERVAL <= gap <= MAX_INTERVAL:
            return
        # The least of the latest gaps: where a pool has several agents, each relays only some of a target's
        # scrapes, and its gaps are whole multiples of the interval. A longer interval shows after GAPS gaps.
        t.gaps.append(gap)
        del t.gaps[:-GAPS]
        t.interval = min(t.gaps)

    def owned(self, t: Target) -> bool:
        """Whether this agent scrapes ``t`` in an outage: it relayed the target's latest scrape before the cut.

        The gateway sends every request to a node through one agent of its pool, the same on every replica
        (rendezvous hashing, gateway/rendezvous.py), while that agent is up: the agent that keeps a target is the
        one that relayed its scrapes, and it relayed the latest within an interval of the latest scrape it relayed
        of anything (the cut came less than an interval after it; the margin, a quarter interval and at most 1 s,
        is for the spread of arrivals). Another agent relayed it, if ever, when the pool's agents were not the same.

        Where this agent was the target's only relayer (its latest gaps all one interval) and the scrapes moved
        to another agent (one joined the pool, or came back), that one can scrape it only once it has learned the
        interval, from its second scrape: this one keeps it for a second interval, so that the target is kept by
        at least one agent through such a change. A gateway that spreads a node's scrapes over the agents (older
        releases: the least busy) shows in the gaps (whole multiples of the interval), and the window stays one
        interval there.
        """
        if not t.learned:
            return False
        window = t.interval + min(1.0, 0.25 * t.interval)
        if len(t.gaps) >= GAPS and max(t.gaps) < 1.5 * t.interval:
            window += t.interval
        return t.last >= self.latest - window


class OutageScraper:
    """While ``connected()`` is false, scrape every learned target at its cadence into ``backlog``."""

    def __init__(self, learner: Learner, backlog: Backlog, upstream: UpstreamPool,
                 nodes: Callable[[], dict[str, str]], policy: Callable[[], Policy],
                 connected: Callable[[], bool], metrics: BackfillMetrics, max_page: int = 64 * 1024 * 1024,
                 concurrency: int = 64) -> None:
        self.learner = learner
        self.backlog = backlog
        self.upstream = upstream
        self.nodes = nodes
        self.policy = policy
        self.connected = connected
        self.metrics = metrics
        self.max_page = max_page
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._log = RateLimitedLog(log)
        self.scraping = False

    async def run(self, check_every: float = 0.25) -> None:
        try:
            while True:
                if self.connected() or not any(t.learned for t in self.learner.targets.values()):
                    await asyncio.sleep(check_every)  # nothing learned (a start): nothing to scrape
                    continue
                await self._outage(check_every)
        finally:
            await cancel_and_wait(self._tasks)

    async def _outage(self, check_every: float) -> None:
        """Scrape until a session is back. Each target is due on its own phase: its last scrape plus intervals."""
        now = time.time()
        due: list[tuple[float, tuple[str, int, str]]] = []
        for key, t in self.learner.targets.items():
            if self.learner.owned(t):
                k = max(1, -(-(now - t.last) // t.interval))  # the next whole interval after now
                heapq.heappush(due, (t.last + k * t.interval, key))
        log.warning("no gateway heard (no session, or a silent one): scraping %d target(s) of this pool myself and "
                    "keeping the pages (backlog holds %d scrape(s), %d bytes)", len(due), self.backlog.scrapes,
                    self.backlog.bytes)
        self.scraping = True
        try:
            while not self.connected():
                now = time.time()
                while due and due[0][0] <= now:
                    at, key = heapq.heappop(due)
                    target = self.learner.targets.get(key)
                    if target is None:
                        continue
                    task = asyncio.get_running_loop().create_task(self._scrape(target, at))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    nxt = at + target.interval
                    heapq.heappush(due, (nxt if nxt > now else now + target.interval, key))
                wait = min(check_every, (due[0][0] - now) if due else check_every)
                await asyncio.sleep(max(0.0, wait))
        finally:
            self.scraping = False
        log.info("a gateway is heard again: stopped scraping (backlog %d scrape(s), %d bytes)", self.backlog.scrapes,
                 self.backlog.bytes)

    async def _scrape(self, t: Target, at: float) -> None:
        ts_ms = int(at * 1000)
        async with self._slots:
            frame = wire.Open(0, wire.StreamKind.HTTP, t.node, t.port, "GET", t.path, (("accept", t.accept),))
            try:
                req = check_open(frame, self.nodes().get(t.node), self.policy())
            except Refusal as refused:
                self._log.info(t.node, "refused", "not scraping %s:%d during the outage: %s", t.node, t.port,
                               refused.text)
                return
            try:
                async with asyncio.timeout(t.timeout):
                    page = await self._get(req.address, t.port, t.path, req.headers)
            except (TimeoutError, UpstreamError, ConnectionError, OSError, _PageRefused) as exc:
                self.metrics.failed.inc()
                why = "timed out" if isinstance(exc, TimeoutError) else str(exc)[:200]
                self._log.info(t.node, "scrape", "scrape of %s:%d during the outage failed: %s", t.node, t.port, why)
                return
        if self.connected():
            return  # the live path has it (Prometheus scrapes again)
        self.backlog.add(t.node, t.port, ts_ms, page)
        self.metrics.kept.inc()
        self.metrics.backlog_bytes.set(self.backlog.bytes)
        self.metrics.backlog_scrapes.set(self.backlog.scrapes)

    async def _get(self, address: str, port: int, path: str, headers: wire.Headers) -> bytes:
        resp = await self.upstream.request(address, port, "GET", path, headers)
        try:
            if resp.status != 200:
                raise _PageRefused(f"answered {resp.status}")
            body = bytearray()
            while True:
                chunk, last = await resp.read()
                body += chunk
                if len(body) > self.max_page:
                    raise _PageRefused(f"page over {self.max_page} bytes")
                if last:
                    return bytes(body)
        finally:
            resp.release()


class _PageRefused(Exception):
    pass
