"""Which agent sessions can serve which edge node, and which one a request goes to.

A session is keyed by (agent identity, session id); removing a session never removes a
newer one of the same agent. Each node belongs to one pool: the pool the gateway's configuration
(``pools.<pool>.nodes``) or its Node object (Kubernetes) puts it in, else the first live claim's.
A claim from an agent certified for another pool is refused with a reason.
Selection is per node over the few sessions that claim it: of the usable ones (not draining, not closed), the
agent that rendezvous hashing gives the node (gateway/rendezvous.py), so that one agent of a pool relays, and in an
outage keeps, a node's scrapes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gateway import rendezvous
from gateway.avoidance import Avoidance
from gateway.nodeview import NodeView, RefusedClaim
from raven.dns.names import NameRule
from raven.lograte import RateLimitedLog
from raven.ops import gcpause
from raven.protocol import wire
from raven.refusals import Reason, Refusal
from raven.transport.tunnel import Tunnel

log = logging.getLogger("raven.gateway.registry")


@dataclass(eq=False, slots=True)
class AgentSession:
    agent: str
    session_id: str
    pools: frozenset[str]
    session: Tunnel
    peer: str = ""
    cidrs: tuple[str, ...] = ()  # layer 3: what the certificate lets the agent announce (urn:raven:cidr:)
    release: str = ""  # the agent's release as its HELLO announced it (empty: 0.1.0, which announced none)
    connected_at: float = field(default_factory=time.time)
    clock_offset: float | None = None  # the agent's clock minus this gateway's when it connected (seconds)
    nodes: set[str] = field(default_factory=set)
    last_register: tuple[wire.NodeInfo, ...] = ()  # re-evaluated when Node objects change
    pending_register: wire.Register | None = None  # held back by the rate limit; a newer one replaces it
    register_timer: asyncio.TimerHandle | None = None  # applies the held one when the rate allows
    # What the latest registration had refused: how many, and the first few (the status page shows them).
    refused_count: int = 0
    refused_sample: tuple[tuple[str, Refusal], ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.agent, self.session_id)

    @property
    def usable(self) -> bool:
        """New streams may go here: the session is OPEN (neither side ended it, the agent is not draining) and
        has stream ids left (raven/protocol/state.py)."""
        return self.session.usable

    def __repr__(self) -> str:
        return f"<agent {self.agent} session {self.session_id[:8]} pools={sorted(self.pools)}>"


@dataclass(slots=True)
class NodeEntry:
    name: str
    address: str
    pool: str
    sessions: list[AgentSession] = field(default_factory=list)
    released_at: float | None = None  # when the last claim went away
    # Agents whose latest registration lists it: a few per node, so a tuple (an empty set costs 200 bytes).
    listed_by: tuple[str, ...] = ()
    # The node as last registered: the agents of a pool register the same nodes, and equal registrations
    # share this one object (and its strings) in their sessions' last_register.
    info: wire.NodeInfo | None = None


MAX_REFUSED_KEPT = 1000  # refused claims kept for the status page; the rest are counted

REFUSED_SAMPLE = 5  # refusals of a registration kept for the status page (the count covers the rest)

_ADDRESS = re.compile(r"[A-Za-z0-9_.:%-]{1,253}")  # IPv4, IPv6 (with a zone) or a host name


def told(refused: Iterable[tuple[str, Refusal]]) -> list[tuple[str, str]]:
    """Refused claims as the agent is told them in REGISTERED: (node, the refusal's text). The text is for the
    agent's log; the metric's label is ``refusal.reason.label``, never the words."""
    return [(name, refusal.text) for name, refusal in refused]


Reevaluation = tuple[AgentSession, list[str], list[tuple[str, Refusal]]]


class Lookup:
    """Result of resolving a node name: the entry (or None), and the :class:`Refusal` when it cannot be used
    (``UNKNOWN_NODE``: no agent claimed it; ``UNAVAILABLE``: its pool has no agent connected)."""

    __slots__ = ("entry", "refusal")

    def __init__(self, entry: NodeEntry | None, refusal: Refusal | None = None) -> None:
        self.entry = entry
        self.refusal = refusal


class Registry:
    def __init__(
        self,
        on_change: Callable[[], None] | None = None,
        rebind_after: float = 3600.0,
        max_nodes_per_agent: int = 10000,
        name_suffixes: tuple[str, ...] = (),
        max_nodes_total: int = 50000,
        hosts_budget: int | None = None,
        hosts_cost: Callable[[str], int] = lambda name: 0,
        names: NameRule | None = None,
    ) -> None:
        self.names = names or NameRule()
        self._log = RateLimitedLog(log)  # lines an agent's registrations cause: per agent identity and kind
        self.sessions: dict[tuple[str, str], AgentSession] = {}
        self.nodes: dict[str, NodeEntry] = {}
        self.avoidance = Avoidance()  # (node, agent) paths that failed lately (gateway/avoidance.py)
        self.pool_nodes: dict[str, set[str]] = {}  # pool -> node names, for per-pool work without a scan
        self.on_change = on_change
        self.rebind_after = rebind_after
        # Caps count per agent identity (all its sessions together), and in total.
        self.max_nodes_per_agent = max_nodes_per_agent
        self.max_nodes_total = max_nodes_total
        # The hosts file must fit where it is published (a ConfigMap holds 1 MiB): each name costs
        # hosts_cost(name) bytes of it, and names that would not fit are refused at registration.
        self.hosts_budget = hosts_budget
        self.hosts_cost = hosts_cost
        self.hosts_bytes = 0
        self.name_suffixes = name_suffixes  # dotted names an agent may claim (besides Node objects)
        # In Kubernetes, the Node objects say which pool a node is in: name -> pool, or None until synced.
        self.authority: dict[str, str | None] | None = None
        # The gateway's configuration lists nodes of its pools (pools.<pool>.nodes): name -> pool. A node listed
        # there belongs to that pool, with or without Kubernetes: no agent of another pool may claim it.
        self.placed: Mapping[str, str] = {}
        # The views' copy of every node (see node_views): replaced, never changed, once handed out.
        self.version = 0
        self._views: dict[str, NodeView] = {}
        self._stale: set[str] = set()  # nodes changed since the views' copy was made
        self._handed_out = False  # the views' map went to a reader since it was made: the next change copies it
        self.refused: dict[str, RefusedClaim] = {}  # latest registrations' refused nodes, MAX_REFUSED_KEPT at most
        self.refused_dropped = 0  # refused claims not kept (over MAX_REFUSED_KEPT)
        self._reachable = (-1, 0)  # (node views' version, nodes with a session then)

    # ------------------------------------------------------------ sessions

    def set_hosts_cost(self, cost: Callable[[str], int]) -> None:
        """The service addresses changed (a reload): every name's share of the hosts file is counted again."""
        self.hosts_cost = cost
        self.hosts_bytes = sum(cost(name) for name in self.nodes)

    def agent_sessions(self, agent: str) -> int:
        """Sessions this agent identity holds now (to this replica)."""
        return sum(1 for (name, _) in self.sessions if name == agent)

    def add_session(self, s: AgentSession) -> AgentSession | None:
        """Add a session; returns the older session with the same key, which the caller closes."""
        old = self.sessions.get(s.key)
        if old is not None:
            self._drop_claims(old)
        self.sessions[s.key] = s
        return old

    def remove_session(self, s: AgentSession) -> bool:
        """Remove exactly this session object (never a newer one with the same key)."""
        if self.sessions.get(s.key) is s:
            del self.sessions[s.key]
        else:
            # Already replaced: its claims were dropped when the newer one arrived.
            return False
        self._drop_claims(s)
        if not any(x.agent == s.agent for x in self.sessions.values()):
            self._drop_refused(s.agent)
        self._changed()
        return True

    def _drop_claims(self, s: AgentSession) -> None:
        for name in s.nodes:
            self._unclaim(name, s)
        s.nodes = set()

    def _unclaim(self, name: str, s: AgentSession, withdrawn: bool = False) -> None:
        """Drop one session's claim. ``withdrawn``: the agent re-registered without the node (it left
        its pool), as opposed to the session going away (the node is still there, unreachable)."""
        entry = self.nodes.get(name)
        if entry is not None and s in entry.sessions:
            entry.sessions.remove(s)
            self._stale.add(name)
            if not entry.sessions:
                if withdrawn:
                    self._forget(entry, s.agent)
                else:
                    entry.released_at = time.monotonic()

    def _forget(self, entry: NodeEntry, by: str) -> None:
        del self.nodes[entry.name]
        self._stale.add(entry.name)
        self.hosts_bytes -= self.hosts_cost(entry.name)
        names = self.pool_nodes.get(entry.pool)
        if names is not None:
            names.discard(entry.name)
            if not names:
                del self.pool_nodes[entry.pool]
        self._log.info(by, "left", "node %r left pool %r: no agent registers it any more (last: agent %s)",
                       entry.name, entry.pool, by)

    # ------------------------------------------------------------ registration

    def register(
        self, s: AgentSession, nodes: Iterable[wire.NodeInfo]
    ) -> tuple[list[str], list[tuple[str, Refusal]]]:
        """Replace the set of nodes ``s`` serves. Returns (accepted, [(node, refusal), ...]): the agent is told
        each refusal's text (:func:`told`), the metric counts its reason."""
        accepted: list[str] = []
        refused: list[tuple[str, Refusal]] = []
        wanted: dict[str, wire.NodeInfo] = {}
        shared: dict[int, wire.NodeInfo] = {}  # id of a registered NodeInfo -> the equal one already held
        s.last_register = tuple(nodes)
        # What the same agent identity holds through its other sessions counts against its cap too.
        held = set().union(*(x.nodes for x in self.sessions.values() if x.agent == s.agent and x is not s))
        new_names = 0  # names this registration adds to the registry (for the total cap and hosts budget)
        self._drop_refused(s.agent)  # this registration is the agent's whole list: its refusals are said again
        new_bytes = 0
        for info in s.last_register:
            refusal = self._refusal(s, info)
            if refusal is None and info.name in wanted:
                refusal = Refusal(Reason.DUPLICATE, "listed twice in one registration")
            if refusal is None and info.name not in held and len(wanted) + len(held) >= self.max_nodes_per_agent:
                refusal = Refusal(Reason.AGENT_NODE_CAP, f"agent {s.agent} may register at most "
                                  f"{self.max_nodes_per_agent} nodes (max_nodes_per_agent)")
            if refusal is None and info.name not in self.nodes:
                if len(self.nodes) + new_names >= self.max_nodes_total:
                    refusal = Refusal(Reason.NODE_CAP, f"this gateway holds {self.max_nodes_total} nodes already "
                                      "(max_nodes_total)")
                elif self.hosts_budget is not None:
                    cost = self.hosts_cost(info.name)
                    if self.hosts_bytes + new_bytes + cost > self.hosts_budget:
                        refusal = Refusal(Reason.HOSTS_BUDGET, f"the hosts file would exceed {self.hosts_budget} "
                                          "bytes, the most its ConfigMap can hold")
                    else:
                        new_bytes += cost
                if refusal is None:
                    new_names += 1
            if refusal is not None:
                refused.append((info.name, refusal))
                self._keep_refused(RefusedClaim(info.name[:253], info.pool[:63], s.agent, refusal.text, time.time()))
                # One line per agent a minute, with a count of the rest: churn cannot grow the log.
                self._log.warning(s.agent, "refused", "refused registration of node %r (pool %r) from agent %s: %s",
                                  info.name[:253], info.pool[:63], s.agent, refusal.text)
                continue
            wanted[info.name] = info
        for name in list(s.nodes):
            if name not in wanted:
                self._unclaim(name, s, withdrawn=True)
                s.nodes.discard(name)
        for name, info in wanted.items():
            entry = self.nodes.get(name)
            if entry is not None and entry.pool != info.pool and entry.sessions:
                # Only reachable when a Node object or the configuration contradicts the earlier claims: it wins.
                self._log.warning(s.agent, "pool-changed", "node %r: its Node object or the gateway's configuration "
                                  "says pool %r; dropping the claims of pool %r", name, info.pool, entry.pool)
                for holder in entry.sessions:
                    holder.nodes.discard(name)
                entry.sessions.clear()
            if entry is None or (not entry.sessions and entry.pool != info.pool):
                if entry is not None:
                    self._log.warning(s.agent, "pool-moved", "node %r moves from pool %r to pool %r (its binding "
                                      "expired)", name, entry.pool, info.pool)
                if entry is not None:
                    self.pool_nodes.get(entry.pool, set()).discard(name)
                else:
                    self.hosts_bytes += self.hosts_cost(name)
                entry = NodeEntry(name, info.address, info.pool)
                self.nodes[name] = entry
                self._stale.add(name)
                self.pool_nodes.setdefault(info.pool, set()).add(name)
            if entry.address != info.address:
                entry.address = info.address
                self._stale.add(name)
            if entry.info == info:
                shared[id(info)] = entry.info
            else:
                entry.info = info
            if entry.released_at is not None:
                entry.released_at = None
                self._stale.add(name)
            if s.agent not in entry.listed_by:
                entry.listed_by += (s.agent,)
            if s not in entry.sessions:
                entry.sessions.append(s)
                self._stale.add(name)
            s.nodes.add(name)
            accepted.append(name)
        s.refused_count, s.refused_sample = len(refused), tuple(refused[:REFUSED_SAMPLE])
        # A registration is this agent's complete list. A node is forgotten (it left its pool) once no
        # agent's latest registration lists it and no session holds it: an agent restarted without it.
        # Nodes that other agents still list stay, whatever this one says.
        for pool in s.pools:
            for name in list(self.pool_nodes.get(pool, ())):
                entry = self.nodes[name]
                if name not in wanted:
                    if s.agent in entry.listed_by:
                        entry.listed_by = tuple(a for a in entry.listed_by if a != s.agent)
                    if not entry.listed_by and not entry.sessions:
                        self._forget(entry, s.agent)
        # Grown one name at a time, a set's table ends up to twice the size a copy gets: these live as long
        # as the session (and the pool), so they are rebuilt at their size.
        s.nodes = set(s.nodes)
        if shared:
            s.last_register = tuple(shared.get(id(info), info) for info in s.last_register)
        for pool in s.pools:
            names = self.pool_nodes.get(pool)
            if names:
                self.pool_nodes[pool] = set(names)
        self._changed()
        return accepted, refused

    def _refusal(self, s: AgentSession, info: wire.NodeInfo) -> Refusal | None:
        refused = self.names.refusal(info.name)  # names that belong to the cluster never reach its DNS
        if refused is not None:
            return refused
        if not _ADDRESS.fullmatch(info.address):
            # Informational for the gateway, but stored and shown (/nodes): bounded like the agent's own config.
            return Refusal(Reason.INVALID_ADDRESS, "address is not an IP address or host name (at most 253 "
                           "characters)")
        if info.pool not in s.pools:
            allowed = ", ".join(sorted(s.pools)) or "none"
            return Refusal(Reason.POOL_NOT_ALLOWED, f"pool {info.pool[:63]!r} is not in this agent's certificate "
                           f"(allowed: {allowed})")
        owner = self.placed.get(info.name)
        if owner is not None and owner != info.pool:
            # A direct or layer-3 pool's node (or any the operator listed): an agent of another pool claiming it
            # would take its scrapes, its name in the hosts file and a second /sd target.
            return Refusal(Reason.CONFIG_POOL, f"the gateway's configuration lists it under pool {owner!r} "
                           f"(pools.{owner}.nodes), not {info.pool[:63]!r}", node=info.name, pool=owner)
        if self.authority is not None:
            if info.name not in self.authority:
                return Refusal(Reason.NO_NODE_OBJECT, "no edge Node object of that name (Kubernetes is the source "
                               "of truth)")
            node_pool = self.authority[info.name]
            if node_pool != info.pool:
                return Refusal(Reason.NODE_OBJECT_POOL, f"the Node object puts it in pool {node_pool!r}, not "
                               f"{info.pool[:63]!r}", pool=node_pool or "")
            return None  # the Node object overrides earlier claims and bindings
        if owner is not None:
            return None  # so does the configuration
        if "." in info.name and not info.name.endswith(self.name_suffixes or ("\0",)):
            allowed = ", ".join(self.name_suffixes) or "none configured"
            return Refusal(Reason.DOTTED_NAME, f"dotted names can only be claimed when they are Node objects or end "
                           f"in an allowed suffix (allowed_name_suffixes: {allowed})")
        entry = self.nodes.get(info.name)
        if entry is not None and entry.pool != info.pool:
            if entry.sessions:
                holders = ", ".join(sorted({x.agent for x in entry.sessions}))
                return Refusal(Reason.CLAIMED_BY_OTHER_POOL, f"node already registered by pool {entry.pool!r} "
                               f"(agents: {holders})", pool=entry.pool)
            released = time.monotonic() - (entry.released_at or 0.0)
            if released < self.rebind_after:
                return Refusal(
                    Reason.BOUND_TO_OTHER_POOL,
                    f"node is bound to pool {entry.pool!r} (its agents left {released:.0f}s ago; another pool may "
                    f"claim it after {self.rebind_after:.0f}s)", pool=entry.pool,
                )
        return None

    def set_authority(self, authority: dict[str, str | None]) -> list[Reevaluation]:
        """Node objects changed which pool a node is in: re-evaluate every session's last registration.

        Returns (session, accepted, refused) for each session, for the caller to tell the agents.
        """
        if authority == self.authority:
            return []
        self.authority = authority
        return self._reevaluate()

    def set_placed(self, placed: Mapping[str, str]) -> list[Reevaluation]:
        """The configuration's ``pools.<pool>.nodes`` changed (a reload): re-evaluate every session's last
        registration, as :meth:`set_authority` does."""
        if placed == self.placed:
            return []
        self.placed = dict(placed)
        return self._reevaluate()

    def _reevaluate(self) -> list[Reevaluation]:
        return [(s, *self.register(s, s.last_register)) for s in list(self.sessions.values())]

    def _keep_refused(self, claim: RefusedClaim) -> None:
        if claim.name in self.refused or len(self.refused) < MAX_REFUSED_KEPT:
            self.refused[claim.name] = claim
        else:
            self.refused_dropped += 1

    def _drop_refused(self, agent: str) -> None:
        """Forget an agent's refused claims (it registers anew, or its last session left)."""
        mine = [name for name, claim in self.refused.items() if claim.agent == agent]
        for name in mine:
            del self.refused[name]
        if not self.refused:
            self.refused_dropped = 0

    def node_views(self) -> tuple[int, dict[str, NodeView]]:
        """(version, name -> :class:`NodeView`) of every registered node. The mapping is one that nothing changes
        once handed out (a worker thread may read it). It is kept up to date as registrations change it (each
        registration or departure remakes the views of the nodes it changed, :meth:`_refresh_views`), so that a
        read finds it made: the first read after the fleet registered used to make 10,000 views on the event
        loop in one piece (18-88 ms). The version goes up whenever the mapping is another."""
        self._refresh_views()
        self._handed_out = True
        return self.version, self._views

    def _refresh_views(self) -> None:
        """Remake the views of the nodes changed since the last call: in place when no reader holds the map (a
        series of registrations with no read between them copies nothing), in a copy otherwise."""
        if not self._stale:
            return
        views = dict(self._views) if self._handed_out else self._views
        make = tuple.__new__  # NodeView(...) without its Python-level __new__: this runs per changed node
        for name in self._stale:
            e = self.nodes.get(name)
            if e is None:
                views.pop(name, None)
                continue
            sessions = e.sessions
            agents = ((sessions[0].agent,) if len(sessions) == 1 else
                      tuple(sorted({x.agent for x in sessions})) if sessions else ())
            views[name] = make(NodeView, (e.name, e.pool, e.address, agents, e.released_at))
        if len(self._stale) > 64:  # many new long-lived objects: frozen out of the collector's way soon
            gcpause.settle_soon()
        self._stale.clear()
        self._views = views
        self._handed_out = False
        self.version += 1

    def reachable_count(self) -> int:
        """How many nodes an agent session holds now: counted once per version of the node views (``/readyz`` and
        the status ask at every read; a count of 10,000 entries each time was a few milliseconds on the loop)."""
        version, views = self.node_views()
        if self._reachable[0] != version:
            self._reachable = (version, sum(1 for v in views.values() if v.agents))
        return self._reachable[1]

    def _changed(self) -> None:
        self._refresh_views()  # at the change, a registration's own nodes: never the whole fleet at a read
        if self.on_change is not None:
            self.on_change()

    # ------------------------------------------------------------ lookup and selection

    def lookup(self, node: str) -> Lookup:
        entry = self.nodes.get(node)
        if entry is None:
            return Lookup(None, Refusal(Reason.UNKNOWN_NODE, f"node {node!r} is not registered with this gateway: no "
                                        "agent has claimed it"))
        if not entry.sessions:
            return Lookup(entry, Refusal(Reason.UNAVAILABLE, f"node {node!r} belongs to pool {entry.pool!r}, which "
                                         "has no agent connected"))
        return Lookup(entry)

    def select(self, entry: NodeEntry, exclude: Iterable[AgentSession] = ()) -> AgentSession | None:
        """The usable session of the agent that rendezvous hashing gives the node (gateway/rendezvous.py): the
        same agent for every request to the node, on every replica, while it can take them; the next by weight
        when it cannot or is excluded, or has failed the node lately (gateway/avoidance.py) and another can."""
        if avoid := self.avoidance.avoided(entry.name):
            exclude = list(exclude)
            avoided = [s for s in entry.sessions if s.agent in avoid]
            if (chosen := rendezvous.choose(entry.name, entry.sessions, exclude + avoided)) is not None:
                return chosen
        return rendezvous.choose(entry.name, entry.sessions, exclude)

    @staticmethod
    def has_alternative(entry: NodeEntry, exclude: Iterable[AgentSession]) -> bool:
        """Whether :meth:`select` would find another usable session."""
        excluded = set(exclude)
        return any(s.usable and s not in excluded for s in entry.sessions)

    # ------------------------------------------------------------ views

    def pools(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for entry in self.nodes.values():
            if entry.sessions:
                out.setdefault(entry.pool, []).append(entry.name)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def known_nodes(self) -> list[NodeEntry]:
        """Every node an agent registered and did not withdraw, reachable now or not."""
        return sorted(self.nodes.values(), key=lambda e: e.name)

    def reachable_nodes(self) -> list[NodeEntry]:
        return sorted((e for e in self.nodes.values() if e.sessions), key=lambda e: e.name)
