"""The front door's admission: whether a request may go to a node at all, and whether there is room for it now.

Before any stream is opened, in this order: the client's credentials (nothing about nodes is revealed without
them), the method, the target (node and port, gateway/request.py), the allowed ports, the connection caps (the
connection guard vouches for an authenticated connection), the pool's reach (a pool Prometheus reaches itself is
never proxied), and whether the node is registered and has an agent. Then, per request, room: the node's cap, the
client's share of the node, and the CONNECT tunnel caps, counted with :class:`~raven.counters.KeyedCounter`.

Every "no" is a :class:`~raven.refusals.Refusal`; the relay (gateway/proxy.py) answers it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from gateway.auth import FrontAuth
from gateway.pools import Pools
from gateway.registry import NodeEntry, Registry
from gateway.request import Target, parse_target
from raven.config import GatewayFront
from raven.counters import KeyedCounter
from raven.deadline import NO_DEADLINE, Deadline
from raven.http.call import ServerCall
from raven.http.guard import ConnectionGuard
from raven.ops.metrics import GatewayMetrics
from raven.refusals import Reason, Refusal

# The connection guard's refusals (raven/http/guard.py) by the label it gives them.
_CONNECTION_REASON = {"over-capacity": Reason.CONNECTION_OVER_CAPACITY, "client-cap": Reason.CONNECTION_CLIENT_CAP}


@dataclass(slots=True)
class Exchange:
    """One request's record: what it asked for, where it went, how it ended.

    Filled in as the request goes; finished (counted, remembered, observed) once, by ``Proxy._finish`` in
    ``Proxy.handle``'s ``finally``, whatever way the request ended.
    """

    request: ServerCall
    start: float
    kind: str = "http"
    node: str = "-"
    pool: str = "-"
    target: Target | None = None
    entry: NodeEntry | None = None
    deadline: Deadline = NO_DEADLINE  # made once the node is known (:meth:`Admission.admit`)
    agent: str = ""
    code: str = ""  # the outcome: a status ("200", "404"), "broken-502", "client-gone", "client-stalled", ...
    reason: str = ""
    last_scrape: bool = True  # the node's outcome (status page); not a refusal of the client's own making
    observe: bool = False  # a complete answer (or a refusal): its duration goes into the latency histogram
    sent: int = 0  # request body bytes to the edge
    received: int = 0  # response body bytes from the edge

    def via(self) -> str:
        """``node 'x' (pool 'p') via agent a``: who the failure is about."""
        return f"node {self.node!r} (pool {self.pool!r}) via agent {self.agent}"


class Admission:
    """The checks before a stream, and the in-flight counts behind the caps (``idle`` is set when none is)."""

    def __init__(
        self,
        cfg: GatewayFront,
        registry: Registry,
        metrics: GatewayMetrics,
        guard: ConnectionGuard,
        settled: Callable[[], bool],
        auth: FrontAuth,
        pools: Pools | None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.guard = guard
        self.settled = settled
        self.auth = auth
        self.pools = pools
        self.node_streams: KeyedCounter[str] = KeyedCounter()  # node -> streams in flight
        self.client_streams: KeyedCounter[tuple[str, str]] = KeyedCounter()  # (client address, node) -> streams
        self.connect_tunnels: KeyedCounter[str] = KeyedCounter()  # client address -> CONNECT tunnels open
        self.idle = asyncio.Event()
        self.idle.set()
        self.configure(cfg)

    def configure(self, cfg: GatewayFront) -> None:
        """Take the front end's settings (at start, and on a configuration reload: for requests from now on)."""
        self.cfg = cfg
        self.allowed_ports = frozenset(cfg.allowed_ports)
        self.allowed_methods = frozenset(cfg.allowed_methods)
        self.allow_header = ", ".join([*cfg.allowed_methods, *(["CONNECT"] if cfg.allow_connect else [])])
        self.client_cap = max(1, int(cfg.client_share * cfg.max_streams_per_node))

    # ------------------------------------------------------------ may it go to the node at all

    def check(self, ex: Exchange) -> None:
        """Fill in ``ex`` (target, node, pool, entry, deadline) or raise the :class:`Refusal` to answer."""
        request = ex.request
        # Credentials first: nothing about nodes, ports or methods is revealed to a client without them.
        proxy_mode = request.method == "CONNECT" or request.raw_path.startswith(("http://", "https://"))
        denied = self.auth.check(lambda name: request.headers.getall(name, []), proxy_mode)
        if denied is not None:
            raise denied
        self._check_method(request)
        target = ex.target = parse_target(request)
        ex.kind = target.kind.name.lower()
        ex.node = target.node
        if target.port not in self.allowed_ports:
            allowed = ", ".join(str(p) for p in sorted(self.allowed_ports))
            raise Refusal(Reason.PORT, f"port {target.port} of node {target.node!r} is not allowed (allowed: "
                                       f"{allowed})")
        found = self.registry.lookup(target.node)
        self._vouch(ex, found.entry)
        if self.pools is not None:  # never proxy to a pool Prometheus reaches itself (gateway/pools.py)
            self.pools.check_proxied(target.node, found.entry)
        if found.entry is None:
            never = self.registry.names.refusal(target.node)
            if never is not None:
                # A name the name rule refuses (localhost, the cluster's names, an address) is never registered:
                # its answer is final, also while this replica is settling.
                raise Refusal(Reason.UNKNOWN_NODE, f"node {target.node!r} is never served by this gateway: "
                              f"{never.text}")
            if not self.settled():
                # A replica that just started does not know every node yet: "try again", not "no such node".
                raise Refusal(Reason.NOT_SETTLED, f"node {target.node!r} is not registered here yet: this gateway "
                              "replica is starting and its agents are still connecting", {"Retry-After": "2"})
            raise found.refusal or Refusal(Reason.UNKNOWN_NODE, f"node {target.node!r} is not registered")
        ex.entry = found.entry
        ex.pool = found.entry.pool
        if found.refusal is not None:
            raise found.refusal
        ex.deadline = Deadline.after(self.budget(request), ex.start)

    def _vouch(self, ex: Exchange, entry: NodeEntry | None) -> None:
        """The request passed the credentials check: its connection is an authenticated one from now on, unless
        it is beyond a connection cap; then it is refused here, where the node is known (status page, metric)."""
        over = self.guard.vouch(ex.request)
        if over is None:
            return
        label, why = over
        ex.pool = entry.pool if entry is not None else "-"
        self.metrics.connection_refusals.labels(ex.pool, label).inc()
        raise Refusal(_CONNECTION_REASON.get(label, Reason.UNAVAILABLE), f"connection for node {ex.node!r} refused: "
                      f"{why}", {"Retry-After": "5"})

    def _check_method(self, request: ServerCall) -> None:
        method = request.method
        if (self.cfg.allow_connect if method == "CONNECT" else method in self.allowed_methods):
            return
        raise Refusal(Reason.METHOD, f"method {method[:20]} is not allowed here (allowed: {self.allow_header})",
                      {"Allow": self.allow_header})

    def budget(self, request: ServerCall) -> float:
        """The seconds the request's deadline gives it: ``request_timeout``, or Prometheus's scrape timeout when
        shorter."""
        timeout = self.cfg.request_timeout
        asked = request.headers.get("X-Prometheus-Scrape-Timeout-Seconds")
        if asked:
            try:
                value = float(asked)
            except ValueError:
                value = 0.0
            if 0 < value < timeout:
                timeout = value
        return timeout

    # ------------------------------------------------------------ is there room now

    def claim(self, node: str, client: str) -> None:
        """Take one of the node's slots for ``client``: no client holds more than its share of a node."""
        n = self.node_streams.count(node)
        if n >= self.cfg.max_streams_per_node:
            raise Refusal(Reason.NODE_BUSY, f"node {node!r} already has {n} requests in flight (limit)")
        key = (client, node)
        mine = self.client_streams.count(key)
        if mine >= self.client_cap:
            raise Refusal(Reason.CLIENT_SHARE, f"this client already has {mine} requests in flight to node "
                                               f"{node!r} (limit {self.client_cap} per client and node)")
        self.node_streams.add(node)
        self.client_streams.add(key)
        self.idle.clear()

    def unclaim(self, node: str, client: str) -> None:
        self.client_streams.remove((client, node))
        self.node_streams.remove(node)
        if not self.node_streams:
            self.idle.set()

    def open_tunnel(self, client: str) -> None:
        """Count a CONNECT tunnel for ``client``, within the caps (all clients, and each one)."""
        if self.connect_tunnels.total >= self.cfg.max_connect_tunnels:
            raise Refusal(Reason.CONNECT_CAP, f"{self.connect_tunnels.total} CONNECT tunnels are open (limit "
                                              f"{self.cfg.max_connect_tunnels})")
        mine = self.connect_tunnels.count(client)
        if mine >= self.cfg.max_connect_per_client:
            raise Refusal(Reason.CONNECT_CLIENT_CAP, f"this client has {mine} CONNECT tunnels open (limit "
                                                     f"{self.cfg.max_connect_per_client})")
        self.connect_tunnels.add(client)

    def close_tunnel(self, client: str) -> None:
        self.connect_tunnels.remove(client)
