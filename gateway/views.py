"""The ops API's views of the fleet (/sd, /nodes, /status, /status.html, /hosts), made off the event loop.

Each read takes, on the loop, only what its render needs: the registry's node views (a mapping nothing changes
once handed out, rebuilt only for the nodes that changed: :meth:`Registry.node_views`), a shallow copy of the
pools' settings (their maps are replaced whole, never changed in place), and for the status a copy of the last
scrapes and of the few sessions' figures. The render, its hash (ETag) and its gzip run in a worker thread
(raven/ops/pages.py); pages are kept by what they were made from: /sd, /nodes and /hosts by the registry's and the
pools' versions (and the query), so that a read when nothing changed is a lookup; the status, whose ages and
last scrapes change every second, for one second. Concurrent readers of one page share one render.

What a change of the registry makes again is not left to the next read: once it is a second old (:meth:`Views.run`,
at most every ``WARM_EVERY`` seconds under churn) a worker thread makes the status's summary of the fleet
(status.Fleet) and the /sd pages asked in the last ``KEEP`` seconds, so that the first read after the fleet
registered finds them made (it used to make them: /sd's 41-46 ms and the summary's 25-28 ms of CPU, in the thread
but holding the interpreter lock the loop needs, at the moment Prometheus and an operator read).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from gateway import discovery, status, statuspage
from gateway.nodeview import NodeView
from gateway.pools import Pools
from raven.aio import retrieve_exception
from raven.logsafe import escape
from raven.ops.pages import Built, Busy, Page, PageCache, Render
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
JSON_PIECE = 256  # list items encoded per json.dumps call (about 50 KB of /sd or /nodes: a millisecond or two)
WARM_AFTER = 1.0  # seconds after a registry change before the views are made again (a burst of changes: one)
WARM_EVERY = 10.0  # at most once in this many seconds while the registry keeps changing (a read between: its own)

log = logging.getLogger("raven.gateway.views")


def _failed(future: asyncio.Future[Any]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _json_items(items: list[Any], per_piece: int = JSON_PIECE) -> bytes:
    """``_json(items)``, byte for byte, encoded ``per_piece`` items at a time: a ``json.dumps`` is one C call that
    keeps the interpreter lock throughout (1.9 MB of /sd in one: 56-94 ms at load 9, the event loop waiting), and
    between pieces the worker thread hands the lock to the loop when it asks."""
    pieces = [_json(items[i:i + per_piece])[1:-1] for i in range(0, len(items), per_piece)]
    return b"[" + b",".join(pieces) + b"]"


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
        self._fleet_making: tuple[Hashable, asyncio.Future[status.Fleet]] | None = None
        self.fleets_made = 0  # summaries of the fleet made (tests and benchmarks read it)
        # The /sd queries asked lately (when, last): made again after a change. As many as sd_pages keeps.
        self._asked: OrderedDict[discovery.SdQuery, float] = OrderedDict()
        self._dirty = asyncio.Event()
        self.warmed = 0  # times the views were made again after a change (tests read it)

    # ------------------------------------------------------------ after a change

    def changed(self) -> None:
        """The registry changed (its ``on_change``): the summary and the /sd pages asked lately are made again soon."""
        self._dirty.set()

    async def run(self) -> None:
        """Make the views again ``WARM_AFTER`` seconds after the registry changed, at most every ``WARM_EVERY``
        seconds: each time the fleet's summary, then each /sd page asked in the last ``KEEP`` seconds, one at a
        time, in a worker thread. Runs until cancelled."""
        while True:
            await self._dirty.wait()
            await asyncio.sleep(WARM_AFTER)
            self._dirty.clear()
            started = time.monotonic()
            try:
                await self.warm()
            except Exception:  # a render that fails is the reads' to report: this task carries on
                log.exception("making the views again after a change failed")
            await asyncio.sleep(max(0.0, started + WARM_EVERY - time.monotonic()))

    async def warm(self) -> None:
        """The fleet's summary and the /sd pages asked lately, made for the registry as it is now."""
        await self.fleet()
        now = time.monotonic()
        for query, asked in list(self._asked.items()):
            if now - asked < KEEP:
                try:
                    await self.sd(query, asked=False)
                except Busy:
                    pass  # readers are making pages already: theirs will be kept
        self.warmed += 1

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

    async def sd(self, query: discovery.SdQuery, asked: bool = True) -> Page:
        """The /sd page for ``query`` (``asked``: a client's, made again after a change; False: :meth:`warm`'s)."""
        reg = self.gw.registry
        version, pools_version, node_views, _ = self._versions()
        if query.pools:
            # Pools no node is in select nothing: dropped from the key, so that made-up names cannot make pages
            # without end (each a render, each pushing Prometheus's own page out of the cache).
            query = query._replace(pools=query.pools & self._known_pools(version, node_views))
            if not query.pools:
                return Page.make(b"[]", JSON)
        if asked:
            self._asked[query] = time.monotonic()
            self._asked.move_to_end(query)
            while len(self._asked) > self.sd_pages.size:
                self._asked.popitem(last=False)
        made_of: Hashable = (version, pools_version, reg.rebind_after)

        def snapshot() -> Render:
            _, _, views, pools = self._versions()
            rebind_after, now = reg.rebind_after, time.monotonic()

            def render() -> Built:
                groups, expires = discovery.groups(views.values(), pools, query, now, rebind_after)
                return Built(Page.make(_json_items(groups), JSON), expires)
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
                head = _json({"replica": made_of[3], "service_addresses": list(addresses)})
                nodes = _json_items([{"name": v.name, "pool": v.pool, "address": v.address, "reach": reach[v.pool],
                                      "agents": list(v.agents)} for v in sorted(views.values(), key=lambda v: v.name)])
                return Built(Page.make(head[:-1] + b',"nodes":' + nodes + b"}", JSON))
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

    async def fleet(self) -> status.Fleet:
        """The status's summary of the node views (status.Fleet), kept per (registry, pools) version: made in a
        worker thread once per change (by :meth:`warm` soon after it, or by the first status read before that),
        read by every status until the next change. Readers that come while it is being made share that one."""
        key = (self.gw.registry.node_views()[0], self.gw.pools.version)
        kept = self._fleet_kept
        if kept is not None and kept[0] == key:
            return kept[1]
        making = self._fleet_making
        if making is None or making[0] != key or _failed(making[1]):
            _, node_views = self.gw.registry.node_views()
            pools = copy.copy(self.gw.pools)
            future = asyncio.ensure_future(asyncio.to_thread(status.fleet_of, node_views, pools))
            future.add_done_callback(retrieve_exception)  # even when no reader waits for it any more
            self._fleet_making = making = (key, future)
            self.fleets_made += 1
        fleet = await asyncio.shield(making[1])
        if self._fleet_making is making:
            self._fleet_making = None
            self._fleet_kept = (key, fleet)  # one reference replaced: a status rendering beside it keeps its own
        return fleet

    async def status_page(self, query: status.StatusQuery, html: bool) -> Page:
        page = self.status_pages.cached((html, query))
        if page is not None:
            return page
        fleet = await self.fleet()

        def snapshot() -> Render:
            same = self._fleet_kept is not None and self._fleet_kept[1] is fleet and self._fleet_kept[0] == (
                self.gw.registry.node_views()[0], self.gw.pools.version)
            inp = self.status_input()

            def render() -> Built:
                # A registration between the summary and this snapshot: the status is made of the snapshot alone.
                snap = status.build(inp, query, fleet if same else None)
                if html:
                    return Built(Page.make(statuspage.render_html(snap).encode(), HTML))
                return Built(Page.make(_json(snap), JSON))
            return render

        return await self.status_pages.get((html, query), snapshot)
