"""The gateway's ops API on the ops port: the status (JSON and a page), the hosts file, the node inventory and
Prometheus's http_sd targets, behind the front end's credentials when it has any.

Every view is made off the event loop and kept while it holds (gateway/views.py); each is answered gzipped to a
client that accepts it, and ``304 Not Modified`` to one whose ``If-None-Match`` still holds (raven/ops/pages.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway import discovery, status
from gateway.views import GatewayState, Views
from raven.ops.pages import Busy, Page, busy, respond

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class OpsApi:
    """The ops endpoints of one gateway (:class:`~gateway.views.GatewayState`, read at each request: reloads show)."""

    def __init__(self, gw: GatewayState) -> None:
        self.gw = gw
        self.views = Views(gw)

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

    @staticmethod
    async def _answer(request: web.Request, page: Awaitable[Page]) -> web.Response:
        try:
            return respond(request, await page)
        except Busy as exc:
            return busy(exc)

    async def _status(self, request: web.Request, html: bool) -> web.Response:
        try:
            query = status.parse_query(list(request.query), request.query.getall)
        except status.BadStatusQuery as exc:
            return web.Response(status=400, text=f"raven: {exc}\n")
        return await self._answer(request, self.views.status_page(query, html))

    async def status(self, request: web.Request) -> web.Response:
        """The status as JSON: ``?pool=``, ``?q=``, ``?state=``, ``?limit=``, ``?offset=`` (gateway/status.py)."""
        return await self._status(request, html=False)

    async def status_page(self, request: web.Request) -> web.Response:
        return await self._status(request, html=True)

    async def hosts_file(self, request: web.Request) -> web.Response:
        return await self._answer(request, self.views.hosts())

    async def nodes(self, request: web.Request) -> web.Response:
        return await self._answer(request, self.views.nodes())

    async def http_sd(self, request: web.Request) -> web.Response:
        """Every pool's targets in Prometheus's http_sd_configs format, with how each is reached
        (gateway/discovery.py). ``?port=``, ``?pool=`` and ``?reach=`` (each repeatable) narrow the list;
        ``?group=pool`` groups the targets that share their labels."""
        try:
            query = discovery.parse_query(request.query, request.query.getall, self.gw.cfg.front.allowed_ports)
        except discovery.BadSdQuery as exc:
            return web.Response(status=400, text=f"{exc}\n")
        return await self._answer(request, self.views.sd(query))
