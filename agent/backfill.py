"""The agent's part of backfill, wired: the learner, the backlog, the outage scraper and the backfill streams.

agent/service.py makes one :class:`Backfill` when ``backfill.enabled``; it routes BACKFILL streams here
(:meth:`on_open`) and runs :meth:`run` beside the dialler.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from agent.backfillserve import BackfillServer
from agent.backlog import Backlog
from agent.checks import Policy
from agent.forwarder import Forwarder
from agent.outage import BackfillMetrics, Learner, OutageScraper
from raven.config.agent import AgentBackfill
from raven.deadline import Deadline
from raven.ops.metrics import AgentMetrics
from raven.protocol import wire
from raven.transport.stream import Stream


class Backfill:
    def __init__(self, cfg: AgentBackfill, forwarder: Forwarder, metrics: AgentMetrics,
                 connected: Callable[[], bool]) -> None:
        self.metrics = BackfillMetrics(metrics.registry)
        m = self.metrics
        self.learner = Learner()
        self.backlog = Backlog(cfg.max_bytes, cfg.max_age, Path(cfg.directory) if cfg.directory else None,
                               max_page=cfg.max_page, on_drop=lambda reason, n: m.dropped.labels(reason).inc(n))
        m.backlog_bytes.set(self.backlog.bytes)
        m.backlog_scrapes.set(self.backlog.scrapes)
        m.targets.set_function(lambda: sum(t.learned for t in self.learner.targets.values()))
        forwarder.on_answered = self._answered
        policy: Callable[[], Policy] = lambda: forwarder.policy  # noqa: E731 (a reload replaces it)
        self.server = BackfillServer(self.backlog, m, cfg.rate, cfg.batch_bytes)
        self.scraper = OutageScraper(self.learner, self.backlog, forwarder.upstream, forwarder.nodes, policy,
                                     connected, m, max_page=cfg.max_page)

    def _answered(self, frame: wire.Open, deadline: Deadline, client: str) -> None:
        """A relayed request answered 200: the learner takes when it arrived (its deadline was made then), on the
        wall clock, with the timeout it was given."""
        arrived = time.time() - deadline.age()
        self.learner.observe(frame, deadline.budget, client, arrived)

    def on_open(self, stream: Stream) -> None:
        self.server.on_open(stream)

    async def run(self) -> None:
        await self.scraper.run()
