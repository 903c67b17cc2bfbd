"""The gateway's ops API on the ops port: the status (JSON and a page), the hosts file, the node inventory and
Prometheus's http_sd targets, behind the front end's credentials when it has any.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway import discovery
from gateway.status import render_html, snapshot

if TYPE_CHECKING:
    from gateway.service import Gateway

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class OpsApi:
    """The ops endpoints of one :class:`~gateway.service.Gateway` (read at each request: reloads show)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def routes(self) -> list[tuple[str, Handler]]:
        return [("/sd", self.http_sd), ("/hosts", self.hosts_file), ("/nodes", self.nodes), ("/status", self.status),
                ("/status.html", self.status_page)]

    def authorize(self, request: web.Request) -> web.Response | None:
        """The inventory endpoints need the front end's bearer token (Prometheus: http_sd_configs.authorization);
        the status page also takes it as a browser's password."""
        if request.path == "/status.html":
            denied = self.gw.auth.check_browser(lambda name: request.headers.getall(name, []))
        else:
            denied = self.gw.auth.check_bearer(lambda name: request.headers.getall(name, []))
        if denied is None:
            return None
        self.gw.metrics.front_refused.labels(denied.label).inc()
        return web.Response(status=denied.status, text=f"raven: {denied.text}\n", headers=denied.headers)

    def snapshot(self) -> dict[str, Any]:
        gw = self.gw
        snap = snapshot(
            replica=gw.cfg.replica_id, replicas=gw.cfg.replicas, started=gw.started_wall, ready=gw.ready(),
            draining=gw.tunnel.draining, registry=gw.registry, last=gw.proxy.last, pools=gw.pools,
        )
        snap["layer3"] = gw.layer3.status() if gw.layer3 is not None else None
        return snap

    async def status(self, _: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    async def status_page(self, _: web.Request) -> web.Response:
        return web.Response(text=render_html(self.snapshot()), content_type="text/html")

    async def hosts_file(self, _: web.Request) -> web.Response:
        whole = await self.gw.hosts.render(shards=1)  # in a worker thread: 100,000 names take a while
        return web.Response(text=whole[0], content_type="text/plain")

    async def nodes(self, _: web.Request) -> web.Response:
        return web.json_response({
            "replica": self.gw.cfg.replica_id,
            "service_addresses": self.gw.cfg.hosts.service_addresses,
            "nodes": [
                {"name": e.name, "pool": e.pool, "address": e.address, "reach": self.gw.pools.reach(e.pool),
                 "agents": sorted({s.agent for s in e.sessions})}
                for e in self.gw.registry.known_nodes()
            ],
        })

    async def http_sd(self, request: web.Request) -> web.Response:
        """Every pool's targets in Prometheus's http_sd_configs format, with how each is reached
        (gateway/discovery.py). ``?port=``, ``?pool=`` and ``?reach=`` (each repeatable) narrow the list."""
        try:
            ports, pools, reaches = discovery.parse_query(request.query, request.query.getall,
                                                          self.gw.cfg.front.allowed_ports)
        except discovery.BadQuery as exc:
            return web.Response(status=400, text=f"{exc}\n")
        return web.json_response(discovery.groups(self.gw.registry.bound_nodes(), self.gw.registry.known_nodes(),
                                                  self.gw.pools, ports, pools, reaches))
