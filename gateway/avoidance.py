"""Which agent a node's requests should avoid for a while: the one that could not reach it.

Rendezvous selection (gateway/rendezvous.py) sends every request to a node through one agent of its pool. When that
agent is up but cannot reach the node (its route to the node broke, a firewall on its side, the node's port
answering only the others) every scrape of the node would fail through it, or take the request's one retry and its
latency. So a failure of the node *through an agent* (the agent could not connect, the agent's deadline passed, or
the gateway's did after the agent had the request for at least ``AVOID_AFTER``, before the response head) makes the
node avoid that agent for a hold that doubles with each failure in a row (15 s, 30 s, ... at most 5 minutes); the
next agent by weight takes the node's requests meanwhile. When the hold has passed, the node's next request tries
its own agent again: a success there ends the avoidance, a failure holds it off twice as long. An avoided agent is
still used when every other agent of the pool is avoided or unusable: a node that no agent can reach fails as it
would without this.

The node's scrapes then go through the other agent, which therefore relays them and keeps the node through an
outage (agent/outage.py): the keeping moves with the scrapes, so the node is still kept by one agent.

What an HTTP answer says (a 5xx from the exporter) is not a failure of the path: only the codes that say the
agent could not reach the node or took too long count. Bounded: at most ``max_entries`` (node, agent) pairs,
the oldest forgotten first; an entry lives no longer than its hold past its last failure.

Each replica learns from its own requests. After every agent of the pool failed the node (the node itself was
down), the one whose hold ends first serves it again first, and may keep it until the other's hold ends (at most
5 minutes) although its own agent works again by then.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from raven.protocol import ResetCode

FIRST_HOLD = 15.0
MAX_HOLD = 300.0
MAX_ENTRIES = 100_000  # (node, agent) pairs: a 10,000-node fleet where every node failed through every agent of 10

# The agent could not reach the node, or the node took too long through it: a fault of that path.
PATH_FAULTS = frozenset({ResetCode.CONNECT_FAILED, ResetCode.TIMEOUT})
# The gateway's own deadline counts only when the agent had the request this long without an answer head: a
# client's tiny scrape timeout (or a budget spent on an earlier attempt) says nothing of the path.
AVOID_AFTER = 1.0


class _Entry:
    __slots__ = ("failures", "until")

    def __init__(self) -> None:
        self.failures = 0
        self.until = 0.0


class Avoidance:
    """(node, agent) pairs that failed, each with its hold. ``clock`` is monotonic seconds."""

    def __init__(self, first_hold: float = FIRST_HOLD, max_hold: float = MAX_HOLD, max_entries: int = MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_hold = first_hold
        self.max_hold = max_hold
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._by_node: dict[str, set[str]] = {}  # node -> agents it has an entry for

    def __len__(self) -> int:
        return len(self._entries)

    def failed(self, node: str, agent: str) -> float:
        """The node failed through the agent: hold it off (twice as long as the last time, in a row). Returns
        the hold in seconds."""
        key = (node, agent)
        entry = self._entries.pop(key, None)
        if entry is None:
            entry = _Entry()
            self._by_node.setdefault(node, set()).add(agent)
        self._entries[key] = entry  # the newest last: the oldest are forgotten first
        entry.failures += 1
        hold: float = min(self.max_hold, self.first_hold * float(2 ** min(entry.failures - 1, 16)))
        entry.until = self.clock() + hold
        while len(self._entries) > self.max_entries:
            self._forget(*next(iter(self._entries)))
        return hold

    def succeeded(self, node: str, agent: str) -> None:
        """A request to the node through the agent got its response head: the path works."""
        if node in self._by_node:
            self._forget(node, agent)

    def avoided(self, node: str) -> frozenset[str]:
        """The agents the node's requests avoid now (empty for nearly every node: one dict lookup)."""
        agents = self._by_node.get(node)
        if not agents:
            return frozenset()
        now = self.clock()
        out = set()
        for agent in list(agents):
            entry = self._entries[(node, agent)]
            if entry.until > now:
                out.add(agent)
            elif now > entry.until + self.max_hold:  # long past its hold and never tried since: forgotten
                self._forget(node, agent)
        return frozenset(out)

    def _forget(self, node: str, agent: str) -> None:
        if self._entries.pop((node, agent), None) is None:
            return
        agents = self._by_node[node]
        agents.discard(agent)
        if not agents:
            del self._by_node[node]
