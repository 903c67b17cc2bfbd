"""The ops API's views of the fleet (/sd, /nodes, /status, /status.html, /hosts), made off the event loop.

Each read takes, on the loop, only what its render needs: the registry's node views (a mapping nothing changes
once handed out, rebuilt only for the nodes that changed: :meth:`Registry.node_views`), a shallow copy of the
pools' settings (their maps are replaced whole, never changed in place), and for the status a copy of the last
scrapes and of the few sessions' figures. The render, its hash (ETag) and its gzip run in a worker thread
(raven/ops/pages.py); pages are kept by what they were made from: /sd, /nodes and /hosts by the registry's and the
pools' versions (and the query), so that a read when nothing changed is a lookup; the status, whose ages and
last scrapes change every second, for one second. Concurrent readers of one page share one render.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from gateway import discovery, status, statuspage
from gateway.nodeview import NodeView
from gateway.pools import Pools
from raven.logsafe import escape
from raven.ops.pages import Built, Page, PageCache, Render
from raven.protocol.state import SessionState

if TYPE_CHECKING:
    from gateway.auth import FrontAuth
    from gateway.layer3 import GatewayLayer3
    from gateway.registry import Registry
    from raven.config import GatewayConfig
    from raven.dns.publisher import HostsPublisher
    from raven.ops.metrics import GatewayMetrics

JSON = "application/json; charset=utf-8"
HTML = "text/html; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
KEEP = 300.0  # seconds a versioned page is kept at most (its key says when it is out of date anyway)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class BackfillState(Protocol):
    """What the views read of the gateway's backfill (gateway/backfill.py): why it is off, each pool's backlog."""

    off_reason: str

    def status(self) -> dict[str, dict[str, float]]: ...


class GatewayState(Protocol):
    """What the ops views and the ops API read of the running gateway (gateway/service.py's ``Gateway`` is one),
    read at each request so that a reload shows."""

    cfg: GatewayConfig
    registry: Registry
    pools: Pools
    hosts: HostsPublisher
    auth: FrontAuth
    metrics: GatewayMetrics
    layer3: GatewayLayer3 | None
    kube_synced: bool
    started_wall: float

    @property
    def draining(self) -> bool: ...
    @property
    def last(self) -> Mapping[str, status.NodeResult]: ...
    @property
    def failing(self) -> Mapping[str, status.NodeResult]: ...
    @property
    def backfill(self) -> BackfillState: ...
    def ready(self) -> tuple[bool, str]: ...


class Views:
    def __init__(self, gw: GatewayState) -> None:
        self.gw = gw
        self.sd_pages = PageCache(max_age=KEEP, size=8)  # per query: a Prometheus job asks one URL
        self.nodes_pages = PageCache(max_age=KEEP, size=2)
        self.hosts_pages = PageCache(max_age=KEEP, size=1)
        self.status_pages = PageCache(max_age=1.0, size=16)
        self._pools_seen: tuple[int, frozenset[str]] = (-1, frozenset())
        self._fleet_kept: tuple[Hashable, status.Fleet] | None = None

    def _versions(self) -> tuple[int, int, dict[str, NodeView], Pools]:
        """(registry version, pools version, node views, a copy of the pools' settings): on the loop."""
        version, views = self.gw.registry.node_views()
        return version, self.gw.pools.version, views, copy.copy(self.gw.pools)

    # ------------------------------------------------------------ /sd

    def _known_pools(self, version: int, views: dict[str, NodeView]) -> frozenset[str]:
        """Every pool a node or the configuration names: counted once per version of the node views."""
        if self._pools_seen[0] != version:
            configured = self.gw.pools.configured_pools()
            self._pools_seen = (version, frozenset({v.pool for v in views.values()}.union(configured)))
        return self._pools_seen[1]

    async def sd(self, query: discovery.SdQuery) -> Page:
        reg = self.gw.registry
        version, pools_version, node_views, _ = self._versions()
        if query.pools:
            # Pools no node is in select nothing: dropped from the key, so that made-up names cannot make pages
            # without end (each a render, each pushing Prometheus's own page out of the cache).
            query = query._replace(pools=query.pools & self._known_pools(version, node_views))
            if not query.pools:
                return Page.make(b"[]", JSON)
        made_of: Hashable = (version, pools_version, reg.rebind_after)

        def snapshot() -> Render:
            _, _, views, pools = self._versions()
            rebind_after, now = reg.rebind_after, time.monotonic()

            def render() -> Built:
                groups, expires = discovery.groups(views.values(), pools, query, now, rebind_after)
                return Built(Page.make(_json(groups), JSON), expires)
            return render

        return await self.sd_pages.get(query, snapshot, made_of)

    # ------------------------------------------------------------ /nodes

    async def nodes(self) -> Page:
        cfg = self.gw.cfg
        version, pools_version, _, _ = self._versions()
        addresses = tuple(cfg.hosts.service_addresses)
        made_of = (version, pools_version, addresses, cfg.replica_id)

        def snapshot() -> Render:
            _, _, views, pools = self._versions()

            def render() -> Built:
                reach = {p: pools.reach(p) for p in {v.pool for v in views.values()}}
                return Built(Page.make(_json({
                    "replica": made_of[3], "service_addresses": list(addresses),
                    "nodes": [{"name": v.name, "pool": v.pool, "address": v.address, "reach": reach[v.pool],
                               "agents": list(v.agents)} for v in sorted(views.values(), key=lambda v: v.name)],
                }), JSON))
            return render

        return await self.nodes_pages.get("nodes", snapshot, made_of)

    # ------------------------------------------------------------ /hosts

    async def hosts(self) -> Page:
        pub = self.gw.hosts
        version, pools_version, _, _ = self._versions()
        made_of = (version, pools_version, tuple(pub.addresses), id(self.gw.registry.names), self.gw.kube_synced)

        def snapshot() -> Render:
            snap = pub.snapshot()  # the publisher's own: names and direct entries copied on the loop

            def render() -> Built:
                contents, _ = pub.render_snapshot(*snap, shards=1)
                return Built(Page.make(contents[0].encode(), TEXT))
            return render

        return await self.hosts_pages.get("hosts", snapshot, made_of)

    # ------------------------------------------------------------ /status, /status.html

    def status_input(self) -> status.StatusInput:
        """What the status is made from, taken on the loop (references and small copies)."""
        gw = self.gw
        reg = gw.registry
        _, views = reg.node_views()
        sessions: list[dict[str, Any]] = []
        for sess in sorted(reg.sessions.values(), key=lambda x: (x.agent, x.session_id)):
            common = {
                "agent": sess.agent, "session": sess.session_id[:8], "peer": sess.peer,
                "age_seconds": 0.0, "connected_at": sess.connected_at, "streams": sess.session.in_flight,
                "draining": sess.session.state is SessionState.DRAINING, "nodes": len(sess.nodes),
                # The agent's release (None: it announced none, so it is 0.1.0) and the protocol agreed with it.
                "version": sess.release or None, "protocol": sess.session.core.version,
                # Its clock minus this gateway's, from its upgrade request's Date (None: it sent none).
                "clock_offset_seconds": sess.clock_offset,
                # Its latest registration's refusals (a node of another pool, a reserved name ...): the count
                # and the first few, each with its reason. The agent chose the names: escaped for a terminal.
                "refused": sess.refused_count,
                "refused_nodes": [{"node": escape(node[:253]), "reason": r.label, "text": escape(r.text)}
                                  for node, r in sess.refused_sample],
            }
            sessions += [{**common, "pool": name} for name in sorted(sess.pools)]
        inp = status.StatusInput(
            replica=gw.cfg.replica_id, replicas=gw.cfg.replicas, started=gw.started_wall, ready=gw.ready(),
            draining=gw.draining, views=views, last=dict(gw.last), sessions=sessions, failing=dict(gw.failing),
            pools=copy.copy(gw.pools), refused=dict(reg.refused), refused_dropped=reg.refused_dropped,
            layer3=gw.layer3.status() if gw.layer3 is not None else None,
            backfill={"off": gw.backfill.off_reason, "pools": gw.backfill.status()},
        )
        for s in sessions:
            s["age_seconds"] = round(max(0.0, inp.now - float(s.pop("connected_at"))), 1)
        return inp

    def _fleet(self, key: Hashable, inp: status.StatusInput) -> status.Fleet:
        """The status's summary of the node views (status.Fleet), kept per (registry, pools) version: made in the
        worker thread at the first status after a change, read by every status until the next one."""
        kept = self._fleet_kept
        if kept is not None and kept[0] == key:
            return kept[1]
        fleet = status.fleet_of(inp.views, inp.pools)
        self._fleet_kept = (key, fleet)  # one reference replaced: a status rendering beside it keeps its own
        return fleet

    async def status_page(self, query: status.StatusQuery, html: bool) -> Page:
        def snapshot() -> Render:
            key = (self.gw.registry.node_views()[0], self.gw.pools.version)
            inp = self.status_input()

            def render() -> Built:
                snap = status.build(inp, query, self._fleet(key, inp))
                if html:
                    return Built(Page.make(statuspage.render_html(snap).encode(), HTML))
                return Built(Page.make(_json(snap), JSON))
            return render

        return await self.status_pages.get((html, query), snapshot)
