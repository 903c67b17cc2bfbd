"""What the agent learns from the scrapes it relays (agent/outage.py): cadence, path, Accept, timeout."""

from __future__ import annotations

import random
import time
import types

from agent.backfill import Backfill
from agent.outage import DEFAULT_ACCEPT, GAPS, Learner, accept_of
from raven.config.agent import AgentBackfill
from raven.deadline import Deadline
from raven.ops.metrics import AgentMetrics
from raven.protocol import wire

PROM_ACCEPT = ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.6,"
               "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4,*/*;q=0.1")


def _scrape(node: str = "edge-gpu-1", target: str = "/metrics", accept: str = PROM_ACCEPT,
            method: str = "GET") -> wire.Open:
    return wire.Open(1, wire.StreamKind.HTTP, node, 9400, method, target, (("Accept", accept),))


def test_cadence_path_accept_and_timeout_are_learned_per_target() -> None:
    ln = Learner()
    for i in range(4):
        ln.observe(_scrape(), 10.0, "prom-0", 1000.0 + 15 * i)
    t = ln.targets[("edge-gpu-1", 9400, "/metrics")]
    assert t.learned and abs(t.interval - 15) < 1e-9
    assert t.timeout == 10.0 and t.last == 1045.0
    assert "protobuf" not in t.accept and "text/plain;version=0.0.4" in t.accept


def test_an_ha_pair_at_the_same_interval_is_not_taken_for_twice_the_rate() -> None:
    ln = Learner()
    for i in range(4):
        ln.observe(_scrape(), 10.0, "prom-0", 1000.0 + 15 * i)
        ln.observe(_scrape(), 10.0, "prom-1", 1007.0 + 15 * i)
    assert abs(ln.targets[("edge-gpu-1", 9400, "/metrics")].interval - 15) < 1e-9


def test_a_shorter_interval_is_taken_at_once_a_longer_one_after_a_few_scrapes() -> None:
    ln = Learner()
    at = 1000.0
    for _ in range(3):
        at += 30
        ln.observe(_scrape(), 10.0, "p", at)
    t = ln.targets[("edge-gpu-1", 9400, "/metrics")]
    at += 15
    ln.observe(_scrape(), 10.0, "p", at)
    assert t.interval == 15
    for _ in range(GAPS):
        at += 60
        ln.observe(_scrape(), 10.0, "p", at)
    assert t.interval == 60


def test_two_agents_of_a_pool_each_learn_the_interval_from_the_scrapes_they_relay() -> None:
    """The gateway spreads a pool's scrapes over its agents: each sees some, at gaps of whole intervals."""
    agents = [Learner(), Learner()]
    rng = random.Random(7)  # the least busy agent: as good as a coin
    for i in range(40):  # 10 minutes at 15 s, two nodes; which agent relays a scrape is the gateway's choice
        for node in ("edge-gpu-1", "edge-gpu-2"):
            relay = agents[rng.randrange(2)]
            relay.observe(_scrape(node=node), 10.0, "p", 1000.0 + 15 * i + (node == "edge-gpu-2") * 4)
    for ln in agents:
        assert {k: round(t.interval) for k, t in ln.targets.items()} == {
            ("edge-gpu-1", 9400, "/metrics"): 15, ("edge-gpu-2", 9400, "/metrics"): 15}


def test_what_is_not_a_scrape_is_not_learned() -> None:
    ln = Learner()
    for i in range(3):
        ln.observe(_scrape(accept="text/html"), 10.0, "browser", 1000.0 + i)
        ln.observe(_scrape(node="edge-gpu-2", method="HEAD"), 10.0, "p", 1000.0 + i)
    assert not ln.targets
    ln.observe(_scrape(), 10.0, "p", 1000.0)
    assert not ln.targets[("edge-gpu-1", 9400, "/metrics")].learned  # one scrape: no cadence, never scraped


def test_the_learned_targets_are_bounded() -> None:
    ln = Learner(max_targets=3)
    for i in range(5):
        ln.observe(_scrape(node=f"edge-gpu-{i}"), 10.0, "p", 1000.0)
    assert len(ln.targets) == 3 and ("edge-gpu-4", 9400, "/metrics") in ln.targets


def test_accept_without_protobuf() -> None:
    assert accept_of((("accept", "application/vnd.google.protobuf;q=0.6,text/plain;version=0.0.4"),)) == \
        "text/plain;version=0.0.4"
    assert accept_of((("accept", "*/*"),)) == ""
    assert DEFAULT_ACCEPT.startswith("text/plain")


def test_behind_an_older_gateway_the_agent_that_relayed_a_targets_latest_scrape_keeps_it() -> None:
    """An older gateway (0.2.0) sends each scrape through the least busy agent, as good as a coin: a pool of 40
    nodes scraped every 15 s, spread over the interval, each scrape relayed by one of two agents; the cut comes at
    a random moment. Each node is kept by one agent at least; a few by two (those whose last scrape came in the
    last moments before the cut). A gateway of this release sends a node's scrapes through one agent
    (tests/unit/test_keepers.py): one keeps it."""
    rng = random.Random(3)
    nodes = [f"edge-gpu-{i}" for i in range(40)]
    offsets = {n: rng.uniform(0, 15) for n in nodes}
    doubled = 0
    for trial in range(20):
        agents = [Learner(), Learner()]
        cut = 1000 + 15 * 20 + rng.uniform(0, 15)
        for i in range(20):
            for n in nodes:
                at = 1000 + 15 * i + offsets[n]
                if at < cut:
                    agents[rng.randrange(2)].observe(_scrape(node=n), 10.0, "p", at)
        keepers = {n: sum(ln.owned(ln.targets[(n, 9400, "/metrics")]) for ln in agents
                          if (n, 9400, "/metrics") in ln.targets) for n in nodes}
        assert min(keepers.values()) >= 1, (trial, keepers)
        twice = [n for n, k in keepers.items() if k == 2]
        doubled += len(twice)
    assert doubled / (20 * len(nodes)) < 0.15, doubled  # 12 % here; 4 % with 1,000 nodes


def test_the_agent_learns_the_interval_from_when_scrapes_arrive_not_when_they_were_answered() -> None:
    """agent/backfill.py hands the learner each relayed scrape's arrival (when its deadline was made), so a node
    whose answers take a varying time (a busy exporter, a pause on the path) is learned at its real interval. Here
    ten scrapes arrived 1 s apart and were all answered in the same instant: gaps between answers would be ~0
    (nothing learned); between arrivals they are the interval."""
    forwarder = types.SimpleNamespace(on_answered=None, upstream=None, nodes=dict, policy=None)
    backfill = Backfill(AgentBackfill(), forwarder, AgentMetrics(), lambda: True)  # type: ignore[arg-type]
    assert forwarder.on_answered is not None
    now = time.monotonic()
    for k in range(10):
        arrived = now - 10.0 + k  # the OPEN's arrival; its deadline was made then
        forwarder.on_answered(_scrape(), Deadline.after(0.9, start=arrived), "p")
    t = backfill.learner.targets[("edge-gpu-1", 9400, "/metrics")]
    assert abs(t.interval - 1.0) < 0.01 and t.timeout == 0.9
    assert abs(t.last - (time.time() - 1.0)) < 0.5  # the latest arrival, on the wall clock
