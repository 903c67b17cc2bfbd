"""What a platform team wants to see at a glance, at fleet size: a summary per pool, then the nodes that need
attention, filtered and paged.

:func:`build` makes one JSON-able picture (``/status`` on the ops port, ``raven status``; the page
``/status.html`` is drawn from it by gateway/statuspage.py) from a :class:`StatusInput`: copies taken on the event
loop (the registry's node views, the last scrapes, the sessions), so that :func:`build` itself runs in a worker
thread (gateway/views.py). It opens on the pools: each one's reach, agents and their sessions, nodes reachable of
all, scrapes failing now and the latest error. Then the nodes, those that need attention first (``failing``: the
latest scrape through this replica failed; ``unreachable``: no agent holds it now; ``refused``: an agent listed
it and the gateway refused it), then ``idle`` (not scraped yet), ``ok`` and ``direct`` (scraped without Raven),
``limit`` of them from ``offset``, with the count of all that match: filters by pool, name (a part of it) and
state.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any, NamedTuple

from gateway.nodeview import NodeView, RefusedClaim
from raven import version
from raven.errors import RavenError
from raven.protocol import wire

if TYPE_CHECKING:
    from gateway.pools import DirectNode, Pools

# The order nodes are listed in: those that need attention first.
STATES = ("failing", "unreachable", "refused", "idle", "ok", "direct")
ATTENTION = frozenset(STATES[:3])
PARAMETERS = ("pool", "q", "state", "limit", "offset")
DEFAULT_LIMIT = 50  # nodes on the first page: at 10,000 nodes the page stays under 100 KB
MAX_LIMIT = 1000  # nodes on one page at most
MAX_POOLS_SHOWN = 200  # pool rows on the page (the JSON has every pool)


@dataclass(slots=True)
class NodeResult:
    """The outcome of the latest request for one node, as the client saw it."""

    at: float  # wall clock
    code: str  # HTTP status sent, or broken-502, client-gone, ...
    reason: str  # empty when it worked


def succeeded(code: str) -> bool:
    return code.isdigit() and 200 <= int(code) < 400


OK_CODES = frozenset(str(code) for code in range(200, 400))  # succeeded(), as one set lookup
_OK = OK_CODES


class BadStatusQuery(RavenError, ValueError):
    """A /status query the gateway will not answer (the message says why)."""


class StatusQuery(NamedTuple):
    pools: frozenset[str] = frozenset()
    q: str = ""  # a part of the node's name, any case
    states: frozenset[str] = frozenset()
    limit: int = DEFAULT_LIMIT
    offset: int = 0

    def as_params(self) -> list[tuple[str, str]]:
        """The query string's parameters that differ from the defaults (the page's links keep them)."""
        out = [("pool", p) for p in sorted(self.pools)] + ([("q", self.q)] if self.q else [])
        out += [("state", s) for s in STATES if s in self.states]
        if self.limit != DEFAULT_LIMIT:
            out.append(("limit", str(self.limit)))
        if self.offset:
            out.append(("offset", str(self.offset)))
        return out


def _count(value: str, name: str, high: int) -> int:
    if not (value.isascii() and value.isdigit() and len(value) <= 9) or int(value) > high:
        raise BadStatusQuery(f"{name} must be a whole number from 0 to {high}, got {value[:20]!r}")
    return int(value)


def parse_query(keys: Sequence[str], getall: Callable[[str, list[str]], list[str]]) -> StatusQuery:
    """The filters and page asked for (``?pool=`` and ``?state=`` repeatable); BadStatusQuery says what is wrong."""
    unknown = sorted(set(keys) - set(PARAMETERS))
    if unknown:
        raise BadStatusQuery(f"unknown parameter(s) {[u[:40] for u in unknown[:5]]}: /status takes "
                       f"{', '.join(p + '=' for p in PARAMETERS)}")
    pools = [p for p in getall("pool", []) if p]
    if len(pools) > 64 or any(len(p) > 63 for p in pools):
        raise BadStatusQuery("pool: at most 64 pools of at most 63 characters each")
    states = [s for s in getall("state", []) if s]
    for s in states:
        if s not in STATES:
            raise BadStatusQuery(f"state must be one of {', '.join(STATES)}, got {s[:20]!r}")
    qs = getall("q", [])
    if len(qs) > 1 or any(len(q) > 253 for q in qs):
        raise BadStatusQuery("q: one part of a node name, at most 253 characters")
    limits, offsets = getall("limit", []), getall("offset", [])
    if len(limits) > 1 or len(offsets) > 1:
        raise BadStatusQuery("limit and offset: once each")
    return StatusQuery(frozenset(pools), qs[0].strip().lower() if qs else "", frozenset(states),
                       _count(limits[0], "limit", MAX_LIMIT) if limits else DEFAULT_LIMIT,
                       _count(offsets[0], "offset", 10**8) if offsets else 0)


@dataclass(slots=True)
class StatusInput:
    """Everything :func:`build` reads: taken on the event loop (references to maps nothing changes any more, and
    small copies), read in a worker thread."""

    replica: str
    replicas: int
    started: float
    ready: tuple[bool, str]
    draining: bool
    views: Mapping[str, NodeView]
    last: Mapping[str, NodeResult]
    sessions: list[dict[str, Any]]  # one per (session, pool): see session_rows
    pools: Pools | None
    refused: Mapping[str, RefusedClaim] = field(default_factory=dict)
    refused_dropped: int = 0
    layer3: dict[str, Any] | None = None
    backfill: dict[str, Any] | None = None  # {"off": why or "", "pools": {pool: backlog}} (gateway/backfill.py)
    now: float = field(default_factory=time.time)
    # The nodes whose latest result failed (the proxy keeps them as it goes: gateway/proxy.py); None: found in last.
    failing: Mapping[str, NodeResult] | None = None


@dataclass(frozen=True, slots=True)
class Fleet:
    """What the status reads of the node views that changes only with them (and the pools' settings): made once
    per version of those, in a worker thread (gateway/views.py keeps it), so that a status made while nothing
    registered walks no node in Python: its counts are set operations, its rows a walk of the sorted names that
    stops at the page's end."""

    rows: dict[str, tuple[int, int]]  # pool -> (nodes, reachable), the direct ones counted as reachable
    names: list[str]  # every node reached through Raven (not direct), sorted
    by_pool: dict[str, frozenset[str]]  # pool -> its nodes of ``names``
    reachable: frozenset[str]  # of ``names``, those an agent holds now
    unreachable: frozenset[str]  # of ``names``, those no agent holds now
    direct: list[DirectNode]  # sorted by name


def fleet_of(views: Mapping[str, NodeView], pools: Pools | None) -> Fleet:
    """One pass over the node views (10,000 nodes: about 10 ms; once per change of the registry or the pools)."""
    direct = pools.direct_nodes(views.values()) if pools is not None else []
    skip = {d.name for d in direct}
    by_pool: dict[str, set[str]] = {}
    reachable: set[str] = set()
    unreachable: set[str] = set()
    for v in views.values():
        if v.name in skip:
            continue
        members = by_pool.get(v.pool)
        if members is None:
            members = by_pool[v.pool] = set()
        members.add(v.name)
        (reachable if v.agents else unreachable).add(v.name)
    rows = {name: (len(members), len(members & reachable)) for name, members in by_pool.items()}
    for d in direct:
        nodes, reached = rows.get(d.pool, (0, 0))
        rows[d.pool] = (nodes + 1, reached + 1)  # Raven is not in the way: Prometheus reaches it (or not) itself
    return Fleet(rows, sorted(reachable | unreachable), {p: frozenset(m) for p, m in by_pool.items()},
                 frozenset(reachable), frozenset(unreachable), direct)


def _pool_row(name: str, pools: Pools | None) -> dict[str, Any]:
    return {"pool": name, "reach": pools.reach(name) if pools else "tunnel",
            "reach_from": pools.source(name) if pools else "default", "agents": [], "nodes": 0, "reachable": 0,
            "failing": 0, "refused": 0, "last_error": None}


def _last(result: NodeResult | None, now: float) -> dict[str, Any] | None:
    if result is None:
        return None
    return {"seconds_ago": round(max(0.0, now - result.at), 1), "code": result.code, "reason": result.reason}


def _first(bucket: Collection[str], names: list[str], skip: int, room: int) -> list[str]:
    """``room`` names of ``bucket`` from the ``skip``-th on, in ``names``'s (sorted) order."""
    if len(bucket) <= 256:  # few (failing nodes, one pool's unreachable ones): sorting them is cheapest
        return sorted(bucket)[skip:skip + room]
    return list(islice(filter(bucket.__contains__, names), skip, skip + room))  # a C walk, stops at the page's end


def build(inp: StatusInput, query: StatusQuery | None = None, fleet: Fleet | None = None) -> dict[str, Any]:
    """The status: every pool's summary, the count of nodes in each state, and the nodes that match ``query``
    (``limit`` of them from ``offset``, those that need attention first). Reads only ``inp`` and ``fleet`` (made
    from ``inp`` when not given: pass the one kept for these node views and pools to walk no node)."""
    query = query or StatusQuery()
    fleet = fleet or fleet_of(inp.views, inp.pools)
    now = inp.now
    out: dict[str, dict[str, Any]] = {name: _pool_row(name, inp.pools)
                                      for name in (inp.pools.configured_pools() if inp.pools else ())}

    def pool(name: str) -> dict[str, Any]:
        row = out.get(name)
        if row is None:
            row = out[name] = _pool_row(name, inp.pools)
        return row

    for agent in inp.sessions:
        pool(agent["pool"])["agents"].append({k: v for k, v in agent.items() if k != "pool"})
    for name, (nodes, reached) in fleet.rows.items():
        counted = pool(name)
        counted["nodes"], counted["reachable"] = nodes, reached
    last, views = inp.last, inp.views
    failed = inp.failing if inp.failing is not None else {n: r for n, r in last.items() if r.code not in _OK}
    # Only the failing nodes are walked one by one (a few, or a pool's worth when its nodes are down).
    failing: dict[str, NodeResult] = {}
    for name, result in failed.items():
        if (name in fleet.reachable or name in fleet.unreachable) and last.get(name) is result:
            failing[name] = result
            p = out[views[name].pool]
            p["failing"] += 1
            worst = p["last_error"]
            if worst is None or result.at > worst[1].at:
                p["last_error"] = (name, result)
    # The nodes that match the filters, per state, as sets of names: C set operations, no Python step per node.
    q, wanted_pools, wanted_states = query.q, query.pools, query.states
    reach_sel: AbstractSet[str] = fleet.reachable
    unreach_sel: AbstractSet[str] = fleet.unreachable
    fail_sel: AbstractSet[str] = frozenset(failing)
    if wanted_pools or q:
        chosen: AbstractSet[str] = (frozenset().union(*(fleet.by_pool.get(p, ()) for p in wanted_pools))
                                    if wanted_pools else frozenset(fleet.names))
        if q:
            chosen = {n for n in chosen if q in n}
        reach_sel, unreach_sel, fail_sel = reach_sel & chosen, unreach_sel & chosen, fail_sel & chosen
    rest = reach_sel - fail_sel
    idle = rest - last.keys()  # held by an agent, not scraped (through this replica) yet
    sets: dict[str, AbstractSet[str]] = {"failing": fail_sel, "unreachable": unreach_sel - fail_sel, "idle": idle}
    found: dict[str, Sequence[Any]] = {
        "refused": [c for c in inp.refused.values()
                    if not ((wanted_pools and c.pool not in wanted_pools) or (q and q not in c.name.lower()))],
        "direct": [d for d in fleet.direct
                   if not ((wanted_pools and d.pool not in wanted_pools) or (q and q not in d.name))],
    }
    for claim in inp.refused.values():
        if claim.pool in out:  # a pool no node is in (the agent may not serve it) gets no row of its own
            out[claim.pool]["refused"] += 1
    counts = {state: len(sets[state]) if state in sets else len(found[state]) for state in STATES if state != "ok"}
    counts["ok"] = len(rest) - len(idle)
    counts = {state: counts[state] for state in STATES}

    def row(state: str, item: Any) -> dict[str, Any]:
        if state == "refused":
            known = out.get(item.pool)
            reach = known["reach"] if known else inp.pools.reach(item.pool) if inp.pools else "tunnel"
            return {"name": item.name, "pool": item.pool, "reach": reach, "state": state,
                    "agents": [item.agent], "last": None, "refused": {
                        "agent": item.agent, "reason": item.reason, "seconds_ago": round(max(0.0, now - item.at), 1)}}
        if state == "direct":
            return {"name": item.name, "pool": item.pool, "reach": item.reach, "state": state, "agents": [],
                    "last": None}
        v = views[item]
        return {"name": v.name, "pool": v.pool, "reach": out[v.pool]["reach"], "state": state,
                "agents": list(v.agents), "last": _last(last.get(v.name), now)}

    page: list[dict[str, Any]] = []
    skip, room = query.offset, query.limit
    for state in STATES:  # those that need attention first, each state's by name
        if wanted_states and state not in wanted_states:
            continue
        if room <= 0:
            break
        if skip >= counts[state]:
            skip -= counts[state]
            continue
        if state in found:
            chosen_items: list[Any] = heapq.nsmallest(skip + room, found[state], key=lambda e: e.name)[skip:]
        else:
            bucket = sets[state] if state != "ok" else rest - idle
            chosen_items = _first(bucket, fleet.names, skip, room)
        page += [row(state, item) for item in chosen_items]
        room -= len(chosen_items)
        skip = 0
    matched = sum(counts[s] for s in STATES if not wanted_states or s in wanted_states)
    for p in out.values():
        if p["last_error"] is not None:
            name, result = p["last_error"]
            p["last_error"] = {"node": name, **(_last(result, now) or {})}
    for name, backlog in (inp.backfill or {}).get("pools", {}).items():
        if not wanted_pools or name in wanted_pools:
            pool(name)["backlog"] = backlog  # what its agent keeps from an outage, not yet written
    return {
        "replica": inp.replica,
        "replicas": inp.replicas,
        "version": version.RELEASE,
        "protocols": list(wire.SUPPORTED_VERSIONS),
        "uptime_seconds": round(max(0.0, now - inp.started), 1),
        "time": round(now, 3),  # this replica's wall clock when the status was taken (raven check: clock skew)
        "ready": inp.ready[0],
        "ready_reason": inp.ready[1],
        "draining": inp.draining,
        "pools": [out[name] for name in sorted(out)],
        "states": counts,
        "refused_not_kept": inp.refused_dropped,
        "filter": {"pool": sorted(wanted_pools), "q": q, "state": [s for s in STATES if s in wanted_states]},
        "matched": matched,
        "offset": query.offset,
        "limit": query.limit,
        "nodes": page,
        "layer3": inp.layer3,
        "backfill_off": (inp.backfill or {}).get("off", ""),
    }
