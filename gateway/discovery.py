"""``/sd``: every pool's targets in Prometheus's http_sd_configs format, each saying how it is reached.

Every target carries ``pool``, ``port`` and ``__meta_raven_reach`` (``tunnel``, ``direct`` or ``layer3``), so
that one scrape job that goes through Raven (``reach`` = tunnel) and one that scrapes directly (the others) can
each keep their own with a ``keep`` relabelling; or ask for one kind with ``?reach=``. A tunnel target is
``NAME:PORT`` (the name resolves to the Raven front end, or is the proxy's target). A direct or layer-3 target is
what Prometheus dials itself: the node's address (its InternalIP) where known and the hosts file does not map its
name, else its name; its ``instance`` label is ``NAME:PORT`` either way, so that series are named alike for every
kind of pool.

Two shapes (``?group=``):

- ``pool`` (what the shipped scrape configs ask for): what Prometheus needs per target and no more. A tunnel
  pool's targets that share their labels are one group: one per pool, port and ``__meta_raven_connected``, its
  targets the names; the scrape config derives ``node`` from the address (``NAME:PORT``) with one relabel rule.
  A direct or layer-3 node keeps its own group: its ``instance`` and ``node`` differ from its address. At 10,000
  nodes and one port: 0.2 MB instead of 1.1 MB (docs/performance.md).
- ``node`` (the default, for scrape configs written before ``group=pool``): one group per node and port, with
  ``node`` and ``__meta_raven_agents`` besides.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from gateway.nodeview import NodeView
from gateway.pools import Pools
from raven.config.pools import REACHES
from raven.errors import RavenError
from raven.protocol.wire import valid_pool_name

PARAMETERS = ("port", "pool", "reach", "group")
SHAPES = ("node", "pool")


class SdQuery(NamedTuple):
    ports: tuple[int, ...]
    pools: frozenset[str]
    reaches: frozenset[str]
    group: str = "node"


class BadSdQuery(RavenError, ValueError):
    """A /sd query the gateway will not answer (the message says why)."""


def parse_query(query: Mapping[str, str], getall: Any, allowed_ports: Sequence[int]) -> SdQuery:
    """The ports, pools, reaches and shape asked for; BadSdQuery for an unknown parameter or value."""
    unknown = sorted(set(query) - set(PARAMETERS))
    if unknown:
        raise BadSdQuery(f"unknown parameter(s) {[u[:40] for u in unknown[:5]]}: /sd takes "
                       f"{', '.join(p + '=' for p in PARAMETERS)}")
    ports = list(allowed_ports)
    wanted = getall("port", [])
    if wanted:
        for value in wanted:
            if not (value.isascii() and value.isdigit()) or int(value) not in ports:
                raise BadSdQuery(f"port must be one of {ports}, got {value[:20]!r}")
        chosen = {int(v) for v in wanted}
        ports = [p for p in ports if p in chosen]
    reaches = set(getall("reach", []))
    for value in reaches:
        if value not in REACHES:
            raise BadSdQuery(f"reach must be one of {', '.join(REACHES)}, got {value[:20]!r}")
    shapes = getall("group", [])
    if len(shapes) > 1 or any(s not in SHAPES for s in shapes):
        raise BadSdQuery(f"group must be one of {', '.join(SHAPES)} (once), got {[s[:20] for s in shapes[:2]]}")
    pools = getall("pool", [])
    if len(pools) > 64:
        raise BadSdQuery("pool: at most 64 pools")
    for value in pools:
        if not valid_pool_name(value):
            raise BadSdQuery(f"pool must be a pool name (an RFC 1123 label), got {value[:63]!r}")
    return SdQuery(tuple(ports), frozenset(pools), frozenset(reaches), shapes[0] if shapes else "node")


def groups(views: Iterable[NodeView], pools: Pools, q: SdQuery, now: float, rebind_after: float
           ) -> tuple[list[dict[str, Any]], float]:
    """The target groups, and until when (``time.monotonic()``) they hold at the latest: tunnel pools' nodes still
    bound to their pool (with an agent now, or whose agents left less than ``rebind_after`` ago), and every other
    pool's known nodes. Reads only its arguments (``pools``: a copy nothing changes), so it runs in a worker thread.

    A tunnel node whose agents are gone (a cut uplink) stays a target, answered 503 by the front end: Prometheus
    records the outage as ``up == 0`` instead of dropping the target, and scrapes it again at its next interval
    once an agent is back, without waiting for a discovery refresh. ``__meta_raven_connected`` says which.
    """
    views = sorted(views, key=lambda v: v.name)
    out: list[dict[str, Any]] = []
    expires = float("inf")
    wanted_pools, reaches, ports = q.pools, q.reaches, q.ports
    if not reaches or "tunnel" in reaches:
        shared: dict[tuple[str, int, bool], list[str]] = {}
        for v in views:
            if (wanted_pools and v.pool not in wanted_pools) or not pools.tunnelled(v.pool):
                continue
            if not v.agents:
                until = (v.released_at if v.released_at is not None else now) + rebind_after
                if until <= now:
                    continue  # no longer bound to its pool: not a target any more
                expires = min(expires, until)
            for port in ports:
                if q.group == "pool":
                    shared.setdefault((v.pool, port, bool(v.agents)), []).append(f"{v.name}:{port}")
                    continue
                out.append({
                    "targets": [f"{v.name}:{port}"],
                    "labels": {"node": v.name, "pool": v.pool, "port": str(port), "__meta_raven_reach": "tunnel",
                               "__meta_raven_connected": "true" if v.agents else "false",
                               "__meta_raven_agents": ",".join(v.agents)},
                })
        for (pool, port, connected), targets in sorted(shared.items()):
            out.append({"targets": targets, "labels": {"pool": pool, "port": str(port), "__meta_raven_reach": "tunnel",
                                                       "__meta_raven_connected": "true" if connected else "false"}})
    if reaches == {"tunnel"}:
        return out, expires
    for node in pools.direct_nodes(views):
        if (wanted_pools and node.pool not in wanted_pools) or (reaches and node.reach not in reaches):
            continue
        address = pools.sd_address(node)
        for port in ports:
            out.append({
                "targets": [f"{address}:{port}"],
                "labels": {"node": node.name, "pool": node.pool, "port": str(port), "instance": f"{node.name}:{port}",
                           "__meta_raven_reach": node.reach},
            })
    return out, expires
