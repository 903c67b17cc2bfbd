"""The operations listener of each service: /metrics, /healthz, /readyz."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge

from raven.hostport import split_host_port
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.http.listener import GuardedSite, guard_middleware
from raven.ops.exposition import Exposition
from raven.ops.pages import Built, Page, PageCache, respond

# The ops port answers probes and scrapes: a few clients, small requests. Its own small caps keep a flood
# there from costing the other listeners their descriptors. Full, it admits a new connection by closing a
# waiting one of the client holding the most (raven/http/eviction.py): connections held from any number
# of addresses cannot keep the kubelet's probes (a new connection each) or a Prometheus out. A request head owed
# for over a second counts as waiting: the kubelet's and Prometheus's follow their connect within milliseconds.
OPS_LIMITS = GuardLimits(head_timeout=10.0, idle_timeout=120.0, max_connections=512, max_per_client=64,
                        evict_grace=1.0)


class MetricsPage:
    """The /metrics page, produced in a worker thread (raven/ops/pages.py), so that the event loop keeps its turns
    while it is built (12 ms of CPU for the gateway's 25 KB page in a quiet process; the interpreter lock changes
    hands every 5 ms), and gzipped there for a client that asks (Prometheus does). What made each read of the
    gateway's page a 100-300 ms spike in the fleet benchmark was a collector that held the lock throughout
    (raven/ops/gcpause.py's frozen count); a thread does not help against that, so collectors must stay cheap.
    prometheus-client's collection is thread-safe (each metric under its lock), and the services' own collectors
    and gauge functions only read counters. Requests that arrive while a page is being produced share it: at most
    one thread renders; none is kept (every scrape sees the counters of its moment)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._exposition = Exposition(registry)  # generate_latest's text, each sample's head formatted once
        self._pages = PageCache(max_age=0.0, size=1)

    def _build(self) -> Built:
        return Built(Page.make(self._exposition.render(), CONTENT_TYPE_LATEST, level=1))

    async def page(self) -> Page:
        return await self._pages.get("metrics", lambda: self._build)


async def start_ops_server(
    listen: str,
    registry: CollectorRegistry,
    ready: Callable[[], tuple[bool, str]],
    extra: Sequence[tuple[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = (),
    authorize: Callable[[web.Request], web.Response | None] | None = None,
) -> web.AppRunner:
    """Serve /metrics, /healthz, /readyz (always open: probes and Prometheus) and ``extra`` endpoints.

    ``authorize`` guards the ``extra`` endpoints (they reveal the inventory): it returns the refusal to send,
    or None to let the request through.
    """
    page = MetricsPage(registry)

    async def metrics(request: web.Request) -> web.Response:
        return respond(request, await page.page())

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        ok, why = ready()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    endpoints = " ".join(["/metrics", "/healthz", "/readyz", *(path for path, _ in extra)])

    @web.middleware
    async def helpful_404(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPNotFound:  # only unknown paths: a wrong method stays a 405 with its Allow header
            return web.Response(status=404, text=f"no endpoint {request.path!r} here; try: {endpoints}\n")

    refused = Counter("raven_ops_refused", "Connections the ops listener refused or closed early, by reason "
                      "(evicted: closed to admit another while the listener was full)", ["reason"], registry=registry)
    guard = ConnectionGuard(f"ops listener {listen}", OPS_LIMITS,
                            on_refused=lambda reason: refused.labels(reason).inc())
    Gauge("raven_ops_connections", f"Connections open on the ops listener (at most {OPS_LIMITS.max_connections})",
          registry=registry).set_function(lambda: guard.connections)
    app = web.Application(middlewares=[guard_middleware(guard), helpful_404])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    for path, handler in extra:
        app.router.add_get(path, handler if authorize is None else _guarded(handler, authorize))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = split_host_port(listen)
    await GuardedSite(runner, host, port, guard).start()
    return runner


def _guarded(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    authorize: Callable[[web.Request], web.Response | None],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def guarded(request: web.Request) -> web.StreamResponse:
        refusal = authorize(request)
        return refusal if refusal is not None else await handler(request)

    return guarded
