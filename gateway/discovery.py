"""``/sd``: every pool's targets in Prometheus's http_sd_configs format, each saying how it is reached.

One group per node and port. Every group carries ``node``, ``pool``, ``port`` and ``__meta_raven_reach``
(``tunnel``, ``direct`` or ``layer3``), so that one scrape job that goes through Raven (``reach`` = tunnel)
and one that scrapes directly (the others) can each keep their own with a ``keep`` relabelling; or ask for
one kind with ``?reach=``. A tunnel target is ``NAME:PORT`` (the name resolves to the Raven front end, or
is the proxy's target). A direct or layer-3 target is what Prometheus dials itself: the node's address
(its InternalIP) where known and the hosts file does not map its name, else its name; its ``instance``
label is ``NAME:PORT`` either way, so that series are named alike for every kind of pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.pools import Pools
from gateway.registry import NodeEntry
from raven.config.pools import REACHES
from raven.errors import RavenError

PARAMETERS = ("port", "pool", "reach")


class BadQuery(RavenError, ValueError):
    """A /sd query the gateway will not answer (the message says why)."""


def parse_query(query: Mapping[str, str], getall: Any, allowed_ports: Sequence[int]
                ) -> tuple[list[int], set[str], set[str]]:
    """(ports, pools, reaches) asked for; BadQuery for an unknown parameter or value."""
    unknown = sorted(set(query) - set(PARAMETERS))
    if unknown:
        raise BadQuery(f"unknown parameter(s) {unknown}: /sd takes {', '.join(p + '=' for p in PARAMETERS)}")
    ports = list(allowed_ports)
    wanted = getall("port", [])
    if wanted:
        for value in wanted:
            if not (value.isascii() and value.isdigit()) or int(value) not in ports:
                raise BadQuery(f"port must be one of {ports}, got {value[:20]!r}")
        chosen = {int(v) for v in wanted}
        ports = [p for p in ports if p in chosen]
    reaches = set(getall("reach", []))
    for value in reaches:
        if value not in REACHES:
            raise BadQuery(f"reach must be one of {', '.join(REACHES)}, got {value[:20]!r}")
    return ports, set(getall("pool", [])), reaches


def groups(bound: Iterable[NodeEntry], known: Iterable[NodeEntry], pools: Pools, ports: Sequence[int],
           wanted_pools: set[str], reaches: set[str]) -> list[dict[str, Any]]:
    """The target groups: tunnel pools' nodes still bound to their pool (with an agent now, or whose agents
    left less than ``node_rebind_after`` ago), and every other pool's known nodes.

    A tunnel node whose agents are gone (a cut uplink) stays a target, answered 503 by the front end: Prometheus
    records the outage as ``up == 0`` instead of dropping the target, and scrapes it again at its next interval
    once an agent is back, without waiting for a discovery refresh. ``__meta_raven_connected`` says which.
    """
    out: list[dict[str, Any]] = []
    if not reaches or "tunnel" in reaches:
        for entry in bound:
            if (wanted_pools and entry.pool not in wanted_pools) or not pools.tunnelled(entry.pool):
                continue
            for port in ports:
                out.append({
                    "targets": [f"{entry.name}:{port}"],
                    "labels": {"node": entry.name, "pool": entry.pool, "port": str(port),
                               "__meta_raven_reach": "tunnel",
                               "__meta_raven_connected": "true" if entry.sessions else "false",
                               "__meta_raven_agents": ",".join(sorted({s.agent for s in entry.sessions}))},
                })
    if reaches == {"tunnel"}:
        return out
    for node in pools.direct_nodes(known):
        if (wanted_pools and node.pool not in wanted_pools) or (reaches and node.reach not in reaches):
            continue
        address = pools.sd_address(node)
        for port in ports:
            out.append({
                "targets": [f"{address}:{port}"],
                "labels": {"node": node.name, "pool": node.pool, "port": str(port), "instance": f"{node.name}:{port}",
                           "__meta_raven_reach": node.reach},
            })
    return out
