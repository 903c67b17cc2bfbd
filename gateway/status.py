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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from gateway.nodeview import NodeView, RefusedClaim
from raven import version
from raven.errors import RavenError
from raven.protocol import wire

if TYPE_CHECKING:
    from gateway.pools import Pools

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


_OK = frozenset(str(code) for code in range(200, 400))  # succeeded(), as one set lookup per node


class BadQuery(RavenError, ValueError):
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
        raise BadQuery(f"{name} must be a whole number from 0 to {high}, got {value[:20]!r}")
    return int(value)


def parse_query(keys: Sequence[str], getall: Callable[[str, list[str]], list[str]]) -> StatusQuery:
    """The filters and page asked for (``?pool=`` and ``?state=`` repeatable); BadQuery says what is wrong."""
    unknown = sorted(set(keys) - set(PARAMETERS))
    if unknown:
        raise BadQuery(f"unknown parameter(s) {[u[:40] for u in unknown[:5]]}: /status takes "
                       f"{', '.join(p + '=' for p in PARAMETERS)}")
    pools = [p for p in getall("pool", []) if p]
    if len(pools) > 64 or any(len(p) > 63 for p in pools):
        raise BadQuery("pool: at most 64 pools of at most 63 characters each")
    states = [s for s in getall("state", []) if s]
    for s in states:
        if s not in STATES:
            raise BadQuery(f"state must be one of {', '.join(STATES)}, got {s[:20]!r}")
    qs = getall("q", [])
    if len(qs) > 1 or any(len(q) > 253 for q in qs):
        raise BadQuery("q: one part of a node name, at most 253 characters")
    limits, offsets = getall("limit", []), getall("offset", [])
    if len(limits) > 1 or len(offsets) > 1:
        raise BadQuery("limit and offset: once each")
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


def _pool_row(name: str, pools: Pools | None) -> dict[str, Any]:
    return {"pool": name, "reach": pools.reach(name) if pools else "tunnel",
            "reach_from": pools.source(name) if pools else "default", "agents": [], "nodes": 0, "reachable": 0,
            "failing": 0, "refused": 0, "last_error": None}


def _last(result: NodeResult | None, now: float) -> dict[str, Any] | None:
    if result is None:
        return None
    return {"seconds_ago": round(max(0.0, now - result.at), 1), "code": result.code, "reason": result.reason}


def build(inp: StatusInput, query: StatusQuery | None = None) -> dict[str, Any]:
    """The status: every pool's summary, the count of nodes in each state, and the nodes that match ``query``
    (``limit`` of them from ``offset``, those that need attention first). Reads only ``inp``."""
    query = query or StatusQuery()
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
    direct = {n.name: n for n in inp.pools.direct_nodes(inp.views.values())} if inp.pools is not None else {}
    # Per state, the nodes that match (a NodeView, DirectNode or RefusedClaim: each has its name first): only the
    # page's rows are made. One loop with no call and no new object per node: at 10,000 nodes it is most of the
    # render, and objects made per node would wake the garbage collector, which holds the event loop too.
    found: dict[str, list[Any]] = {state: [] for state in STATES}
    q, wanted_pools, wanted_states = query.q, query.pools, query.states
    last = inp.last
    for v in inp.views.values():
        name = v.name
        if name in direct:
            continue
        p = out.get(v.pool) or pool(v.pool)
        p["nodes"] += 1
        result = last.get(name)
        if v.agents:
            p["reachable"] += 1
        if result is not None and result.code not in _OK:
            p["failing"] += 1
            worst = p["last_error"]
            if worst is None or result.at > worst[1].at:
                p["last_error"] = (name, result)
            state = "failing"
        else:
            state = "unreachable" if not v.agents else "idle" if result is None else "ok"
        if (wanted_pools and v.pool not in wanted_pools) or (q and q not in name):
            continue
        found[state].append(v)
    for d in direct.values():
        p = pool(d.pool)
        p["nodes"] += 1
        p["reachable"] += 1  # Raven is not in the way: Prometheus reaches it (or not) by itself
        if not ((wanted_pools and d.pool not in wanted_pools) or (q and q not in d.name)):
            found["direct"].append(d)
    for claim in inp.refused.values():
        if claim.pool in out:  # a pool no node is in (the agent may not serve it) gets no row of its own
            out[claim.pool]["refused"] += 1
        if not ((wanted_pools and claim.pool not in wanted_pools) or (q and q not in claim.name.lower())):
            found["refused"].append(claim)
    counts = {state: len(found[state]) for state in STATES}

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
        return {"name": item.name, "pool": item.pool, "reach": out[item.pool]["reach"], "state": state,
                "agents": list(item.agents), "last": _last(last.get(item.name), now)}

    page: list[dict[str, Any]] = []
    skip, room = query.offset, query.limit
    for state in STATES:  # those that need attention first, each state's by name
        bucket = found[state] if not wanted_states or state in wanted_states else []
        if room <= 0:
            break
        if skip >= len(bucket):
            skip -= len(bucket)
            continue
        chosen = heapq.nsmallest(skip + room, bucket, key=lambda e: e.name)[skip:]
        page += [row(state, item) for item in chosen]
        room -= len(chosen)
        skip = 0
    matched = sum(len(found[s]) for s in STATES if not wanted_states or s in wanted_states)
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
