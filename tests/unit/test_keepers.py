"""Which agent of a pool keeps a target through an outage (issue 32; docs/backfill.md): the gateway's choice of agent
(gateway/registry.py, gateway/rendezvous.py) and the agents' rule (agent/outage.py, Learner.owned), together.

The scenario the docs measured: 1,000 nodes, one pool of 2 agents, scraped every 15 s by an HA pair of Prometheus
(each at its own phase per target, each through its own gateway replica), and the uplink cut at a random moment.
The agents compute nothing together; each keeps what it relayed last. Two keeping one target write its samples
twice, at different timestamps (rates and sums doubled for the outage); none keeping it leaves a hole.
"""

from __future__ import annotations

import random

from agent.outage import Learner
from gateway import rendezvous
from gateway.registry import AgentSession, Registry
from raven.protocol import wire
from tests.support.fleetviews import agent

INTERVAL = 15.0
NODES = [f"edge-gpu-{i}" for i in range(1000)]
KEY = 9400


def _scrape(node: str) -> wire.Open:
    return wire.Open(1, wire.StreamKind.HTTP, node, KEY, "GET", "/metrics", (("Accept", "text/plain;version=0.0.4"),))


class Pool:
    """Two gateway replicas (two registries), each holding one session of every agent of the pool, and the agents'
    learners. ``scrape`` is one Prometheus scrape through one replica: the replica picks the agent, the agent
    relays it and learns from it."""

    def __init__(self, agents: list[str], seed: int) -> None:
        self.rng = random.Random(seed)
        self.replicas = [Registry(max_nodes_per_agent=20_000), Registry(max_nodes_per_agent=20_000)]
        self.learners = {name: Learner() for name in agents}
        self.sessions: dict[str, list[AgentSession]] = {}
        for name in agents:
            self.join(name)

    def join(self, name: str) -> None:
        self.learners.setdefault(name, Learner())
        self.sessions[name] = []
        for reg in self.replicas:
            s = agent(name, "pool-a")
            reg.add_session(s)
            reg.register(s, [wire.NodeInfo(n, "10.0.0.1", "pool-a") for n in NODES])
            self.sessions[name].append(s)

    def scrape(self, replica: int, client: str, node: str, at: float) -> None:
        reg = self.replicas[replica]
        for held in self.sessions.values():  # the streams in flight on each session now: other scrapes' load
            held[replica].session.in_flight = self.rng.randrange(4)  # type: ignore[misc]  # a FakeSession
        entry = reg.lookup(node).entry
        assert entry is not None
        chosen = reg.select(entry)
        assert chosen is not None
        self.learners[chosen.agent].observe(_scrape(node), 10.0, client, at + self.rng.uniform(0.02, 0.5))

    def run(self, start: float, until: float, phases: dict[str, list[float]], cut: bool = True) -> None:
        """Every client scrapes every node at its phase each interval from ``start`` until ``until``: the cut
        (a scrape in its last half second is not answered) or, ``cut`` false, a change of the pool."""
        events = []
        k = int(start // INTERVAL)
        while k * INTERVAL < until:
            for node, offsets in phases.items():
                for client, offset in enumerate(offsets):
                    at = k * INTERVAL + offset
                    if start <= at < until - 0.5 * cut:
                        events.append((at, client, node))
            k += 1
        for at, client, node in sorted(events):
            self.scrape(client, f"prom-{client}", node, at)

    def keepers(self) -> dict[str, int]:
        return {n: sum(1 for ln in self.learners.values()
                       if (t := ln.targets.get((n, KEY, "/metrics"))) is not None and ln.owned(t)) for n in NODES}


def _phases(rng: random.Random, clients: int) -> dict[str, list[float]]:
    return {n: [rng.uniform(0, INTERVAL) for _ in range(clients)] for n in NODES}


def test_each_target_is_kept_by_exactly_one_agent_of_a_pool_whose_agents_were_all_up() -> None:
    """The docs' scenario, an HA pair of Prometheus through two replicas, five cuts: no target kept twice or not
    at all. (With the agent picked per request, the least busy, 4 % of the targets were kept by both agents.)"""
    rng = random.Random(11)
    for trial in range(5):
        pool = Pool(["agent-a-1", "agent-a-2"], seed=trial)
        cut = 100_000 + 20 * INTERVAL + rng.uniform(0, INTERVAL)
        pool.run(100_000, cut, _phases(rng, clients=2))
        counts = pool.keepers()
        twice = sorted(n for n, k in counts.items() if k > 1)
        never = sorted(n for n, k in counts.items() if k == 0)
        assert not twice and not never, (trial, len(twice), twice[:5], len(never), never[:5])
        # And the pool's work is shared: each agent relays (and keeps) about half the nodes.
        kept = [sum(ln.owned(t) for t in ln.targets.values()) for ln in pool.learners.values()]
        assert min(kept) > 400, kept


def test_a_target_moved_to_an_agent_that_just_joined_is_kept_by_one_at_least() -> None:
    """An agent joins (or comes back) shortly before the cut: the nodes rendezvous hashing gives it move to it, and
    it learns their interval only from its second scrape. Until then the agent that relayed them keeps them: at
    every moment of a cut within three intervals of the join, no target is kept by none."""
    rng = random.Random(5)
    phases = _phases(rng, clients=1)
    for trial in range(6):
        pool = Pool(["agent-a-1"], seed=trial)
        joined = 100_000 + 20 * INTERVAL + rng.uniform(0, INTERVAL)
        pool.run(100_000, joined, phases, cut=False)
        pool.join("agent-a-2")
        cut = joined + (trial + 0.5) * INTERVAL / 2  # from a quarter to three intervals after the join
        pool.run(joined, cut, phases)
        counts = pool.keepers()
        never = sorted(n for n, k in counts.items() if k == 0)
        assert not never, (trial, cut - joined, len(never), never[:5])


def test_the_agent_is_the_same_on_every_replica_and_moves_only_when_its_agent_goes() -> None:
    a, b, c = (f"agent-{x}" for x in "abc")
    for node in NODES[:200]:
        two = [agent(a, "p"), agent(b, "p")]
        first = rendezvous.choose(node, two)
        assert first is not None and rendezvous.choose(node, list(reversed(two))) is first
        # A third agent takes about a third of the nodes, and takes them from both: none moves between a and b.
        three = [*two, agent(c, "p")]
        now = rendezvous.choose(node, three)
        assert now is first or (now is not None and now.agent == c)
        # The chosen one draining (or excluded after a failure): the other, never none.
        other = rendezvous.choose(node, two, exclude=[first])
        assert other is not None and other is not first
