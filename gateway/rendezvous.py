"""Which of a node's agent sessions a request goes to: rendezvous (highest random weight) hashing of the node over
the agents that claim it, so that every scrape of a node goes through the same agent of its pool while the pool's
agents stay the same, and every gateway replica picks the same one (the weight is a hash of the agent's identity
and the node's name: nothing a replica holds alone).

That agent is the one that relayed the node's scrapes before an outage, and therefore the one that keeps scraping
it (agent/outage.py, :meth:`agent.outage.Learner.owned`): a node is kept by one agent of its pool, not by two
(docs/backfill.md). An HA pair of Prometheus, each through either replica, reaches the node through that agent too.
When it cannot take the request (draining, closed, out of stream ids, excluded after a failed attempt, or set back
for the node after failing it: gateway/avoidance.py) the next agent by weight does, so the node's requests move
only when its agent goes (about 1/n of a pool's nodes move when an agent joins or leaves). Of two sessions of one
agent (a reconnect, briefly), the one with fewer streams in flight.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar


class _Tunnel(Protocol):
    @property
    def in_flight(self) -> int: ...


class _Session(Protocol):
    agent: str

    @property
    def usable(self) -> bool: ...

    @property
    def session(self) -> _Tunnel: ...


S = TypeVar("S", bound=_Session)


def weight(agent: str, node: str) -> int:
    """The agent's weight for the node: the same in every process and release (not Python's salted hash)."""
    digest = hashlib.blake2b(f"{agent}\x00{node}".encode(errors="surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def choose(node: str, sessions: Sequence[S], exclude: Iterable[S] = ()) -> S | None:
    """The usable session, not in ``exclude``, of the agent with the highest weight for ``node``."""
    excluded = set(map(id, exclude))
    best: S | None = None
    best_rank = (0, 0)
    for s in sessions:
        if id(s) in excluded or not s.usable:
            continue
        rank = (weight(s.agent, node), -s.session.in_flight)
        if best is None or rank > best_rank:
            best, best_rank = s, rank
    return best
