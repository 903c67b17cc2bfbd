"""`raven gateway`: the tunnel endpoint, the proxy front end and the ops listener in one process.

The wiring of every part of the gateway (listeners, reload, Kubernetes, drain), read top to bottom from start
to drain; each part lives in its own module (the ops endpoints in gateway/opsapi.py, over gateway/views.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.auth import FrontAuth, TokenSet
from gateway.backfill import Backfill
from gateway.frontserver import front_server
from gateway.layer3 import GatewayLayer3
from gateway.opsapi import OpsApi
from gateway.pools import Pools
from gateway.proxy import Proxy
from gateway.registry import Reevaluation, Registry
from gateway.status import NodeResult
from gateway.tunnel import TunnelEndpoint
from raven import logsafe, pki, version
from raven.config import GatewayConfig
from raven.config.gateway import RESTART_ONLY as GATEWAY_RESTART_ONLY
from raven.config.reload import Reloader, take_over
from raven.dns.hosts import NAMES_ROOM
from raven.dns.publisher import HostsPublisher, file_sink
from raven.hostport import split_host_port
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.http.listener import GuardedSite, descriptor_budget
from raven.ops import gcpause
from raven.ops.fdlimit import check_descriptors
from raven.ops.metrics import GatewayMetrics, set_cert_expiry
from raven.ops.server import start_ops_server
from raven.protocol import wire
from raven.stopsignals import StopSignals
from raven.transport.tls import CertReloader, expiries

if TYPE_CHECKING:
    from raven.kube import KubeNode, LeaseElector

log = logging.getLogger("raven.gateway")


class Gateway:
    def __init__(self, cfg: GatewayConfig, load: Callable[[], GatewayConfig] | None = None,
                 config_path: Path | None = None) -> None:
        self.cfg = cfg
        self.config_reloader = (Reloader(load, self.apply_config, config_path, cfg.config_watch_interval)
                                if load is not None else None)
        self.metrics = GatewayMetrics()
        self.pools = Pools(cfg)
        budget: int | None = None
        if cfg.hosts.configmap is not None:  # a ConfigMap holds 1 MiB: refuse names that would not fit
            budget = NAMES_ROOM * cfg.hosts.shards
        self.registry = Registry(
            rebind_after=cfg.node_rebind_after, max_nodes_per_agent=cfg.max_nodes_per_agent,
            name_suffixes=tuple(cfg.allowed_name_suffixes), max_nodes_total=cfg.max_nodes_total,
            hosts_budget=budget, hosts_cost=self._hosts_cost(cfg), names=cfg.names.rule(),
        )
        self.registry.placed = self.pools.placed()
        sinks = []
        if cfg.hosts.file is not None:
            for k in range(cfg.hosts.shards):  # shard k >= 1 beside it, as <file>.<k>
                path = cfg.hosts.file if k == 0 else cfg.hosts.file.with_name(f"{cfg.hosts.file.name}.{k}")
                sinks.append((str(path), k, file_sink(path)))
        self.hosts = HostsPublisher(self.edge_names, cfg.hosts.service_addresses, cfg.hosts.debounce, sinks,
                                    ready=lambda: self.kube_synced and self.ready()[0], shards=cfg.hosts.shards,
                                    direct=lambda: self.pools.hosts_entries(self.registry.nodes.values()),
                                    select=self.edge_names_allowed)
        ident = pki.load_identity(cfg.tls.cert)
        if ident.role in ("agent", "ca"):
            raise pki.PKIError(
                f"certificate {cfg.tls.cert} is a{'n' if ident.role == 'agent' else ''} {ident.role} certificate, "
                "not a gateway (TLS server) certificate: agents would refuse it; issue one with "
                "'raven certs issue gateway NAME --dns NAME'"
            )
        if ident.role != "gateway":
            log.warning("certificate %s does not list serverAuth: agents accept it only if it has no extended key "
                        "usage at all ('raven certs issue gateway' makes one that says so)", cfg.tls.cert)
        self.tunnel = TunnelEndpoint(cfg, self.registry, self.metrics)
        self.layer3 = GatewayLayer3(cfg.layer3, self.metrics) if cfg.layer3.enabled else None
        self.tunnel.layer3 = self.layer3
        self.reloader = CertReloader(
            cfg.tls, server=True, on_handshake_error=self.tunnel.tls_failed,
            on_loaded=lambda tls: set_cert_expiry(self.metrics.cert_expiry, expiries(tls, "gateway")),
        )
        front = cfg.front
        self.fd_budget = descriptor_budget(front.fd_reserve)
        check_descriptors("gateway", {"front.max_connections": front.max_connections,
                                      "front.fd_reserve (tunnel port, ops port, files)": front.fd_reserve})
        self.front_guard = ConnectionGuard(
            "front end", self._front_limits(cfg),
            on_refused=lambda label: self.metrics.front_refused.labels(label).inc(),
            proven_cap=self._targets_cap,
            on_grown=gcpause.settle_soon,  # keep-alive connections are long-lived: frozen out of the GC's way
        )
        self.metrics.front_connections.labels("authenticated").set_function(
            lambda: self.front_guard.connections - self.front_guard.unproven)
        self.metrics.front_connections.labels("unauthenticated").set_function(lambda: self.front_guard.unproven)
        self.tunnel_guard = ConnectionGuard(
            "tunnel port",
            GuardLimits(cfg.limits.handshake_timeout, cfg.limits.handshake_timeout, cfg.tunnel.max_connections,
                        cfg.tunnel.max_connections_per_address),
            on_refused=lambda label: self.metrics.handshake_failures.labels(label).inc(),
        )
        tokens = TokenSet(front.auth.token_files, front.auth.reload_interval) if front.auth.token_files else None
        self.auth = FrontAuth(tokens)
        logsafe.add_secrets(self._log_secrets)  # a token is redacted wherever it would reach a log line
        self.front_reloader = CertReloader(front.tls, server=True) if front.tls is not None else None
        self.proxy = Proxy(front, self.registry, self.metrics, lambda: self.tunnel.draining, self.front_guard,
                           settled=self.settled, auth=self.auth, pools=self.pools)
        self.ops_api = OpsApi(self)
        self.registry.on_change = self._registry_changed
        self._runners: list[web.BaseRunner] = []
        self._front_sites: list[GuardedSite] = []
        self._background: list[asyncio.Task[None]] = []
        self.kube_nodes: dict[str, KubeNode] = {}
        self.kube_synced: bool = not cfg.kubernetes.enabled
        self._kube_api: Any = None
        self._elector: LeaseElector | None = None
        self._stopped = asyncio.Event()
        self.started = time.monotonic()
        self.started_wall = time.time()
        self._was_ready = False

    @property
    def draining(self) -> bool:
        return self.tunnel.draining

    @property
    def last(self) -> dict[str, NodeResult]:
        """Each registered node's latest request outcome (the status page)."""
        return self.proxy.last

    @property
    def backfill(self) -> Backfill:
        return self.tunnel.backfill

    @property
    def failing(self) -> dict[str, NodeResult]:
        """The registered nodes whose latest request failed (kept as results come in: the status summary)."""
        return self.proxy.failing

    def _log_secrets(self) -> tuple[bytes, ...]:
        tokens = self.auth.tokens
        return tokens.current() if tokens is not None else ()

    def ready(self) -> tuple[bool, str]:
        """Whether this replica should get traffic now (``/readyz``), and why; evaluated on every call.

        Not ready while draining; while the Kubernetes Node list has not arrived (registrations wait for
        it); after a start until its agents are back (see :meth:`_settled`: every edge Node reachable, or
        ``ready_max_wait``, the agents' reconnect bound); and when it has lost every agent session it had for
        longer than ``ready_max_wait`` (it can serve nothing while other replicas may; a reconnect does not flap
        it). A replica that never had an agent is ready after ``ready_max_wait``, so that a rollout before any
        agent exists is not blocked.
        """
        if self.draining:
            return False, "draining"
        if not self.kube_synced:
            return False, "waiting for the Kubernetes Node list"
        if not self._was_ready:
            ok, why = self._settled()
            if not ok:
                return False, why
            self._was_ready = True
        sessions, nodes = len(self.registry.sessions), self.registry.reachable_count()
        empty_since = self.tunnel.empty_since
        if not sessions and empty_since is not None:
            alone = time.monotonic() - empty_since
            if alone > self.cfg.ready_max_wait:
                return False, f"no agent session for {alone:.0f}s: this replica can serve no edge node"
        return True, f"{sessions} agent session(s), {nodes} node(s)"

    def _front_limits(self, cfg: GatewayConfig) -> GuardLimits:
        front = cfg.front
        unproven = min(front.max_unauthenticated, max(1, self.fd_budget // 8))
        cap = min(front.max_connections, max(1, self.fd_budget - unproven))
        if cap < front.max_connections:
            log.warning("the open-files limit leaves %d descriptors beyond the reserve of %d: the front end takes at "
                        "most %d connections (front.max_connections %d needs an open-files limit of %d)",
                        self.fd_budget, front.fd_reserve, cap, front.max_connections,
                        front.max_connections + front.max_unauthenticated + front.fd_reserve)
        return GuardLimits(front.head_timeout, front.idle_timeout, cap, front.max_connections_per_client,
                           max_unproven=unproven,
                           max_unproven_per_client=min(front.max_unauthenticated_per_client, unproven))

    def _targets_cap(self) -> int:
        """Authenticated connections one client address may hold, from the fleet: a Prometheus in DNS mode holds
        one keep-alive connection per target (node x port), plus a quarter for connections being replaced."""
        nodes = max(len(self.registry.nodes), len(self.kube_nodes))
        targets = nodes * len(self.cfg.front.allowed_ports)
        return targets + targets // 4

    def apply_config(self, new: GatewayConfig) -> None:
        """Take over a reloaded configuration without dropping a session or a connection.

        Raises ConfigError (nothing changed then) when a token file of the new configuration is unusable.
        """
        taken = take_over(self.cfg, new, GATEWAY_RESTART_ONLY, log)
        if taken is None:
            return
        cfg, changed = taken
        front = cfg.front
        tokens = TokenSet(front.auth.token_files, front.auth.reload_interval) if front.auth.token_files else None
        self.cfg = cfg
        self.auth.tokens = tokens
        self.pools.configure(cfg)
        self._reevaluated(self.registry.set_placed(self.pools.placed()))  # nodes listed under other pools now
        self.hosts.changed()  # a pool's reach may have changed
        self.proxy.configure(front)
        self.front_guard.limits = self._front_limits(cfg)
        self.tunnel_guard.limits = GuardLimits(cfg.limits.handshake_timeout, cfg.limits.handshake_timeout,
                                               cfg.tunnel.max_connections, cfg.tunnel.max_connections_per_address)
        self.tunnel.configure(cfg)
        reg = self.registry
        reg.rebind_after, reg.max_nodes_per_agent = cfg.node_rebind_after, cfg.max_nodes_per_agent
        reg.max_nodes_total, reg.name_suffixes = cfg.max_nodes_total, tuple(cfg.allowed_name_suffixes)
        reg.names = cfg.names.rule()  # for registrations from now on
        if self.hosts.addresses != cfg.hosts.service_addresses:
            self.hosts.addresses = list(cfg.hosts.service_addresses)
            reg.set_hosts_cost(self._hosts_cost(cfg))
            self.hosts.changed()
        logging.getLogger().setLevel(cfg.log_level.upper())
        log.info("configuration reload: took over %s", ", ".join(changed))

    @staticmethod
    def _hosts_cost(cfg: GatewayConfig) -> Callable[[str], int]:
        addresses = tuple(cfg.hosts.service_addresses)
        return lambda name: sum(len(a) + len(name) + 2 for a in addresses)

    def settled(self) -> bool:
        """Has every agent that may still be reconnecting had its chance (the condition behind /readyz)?

        Until then a node this replica has not heard of is answered 503 "retry", not 404 "no such node".
        """
        return self._was_ready or self._settled()[0]

    def _settled(self) -> tuple[bool, str]:
        """Whether the agents are back after a start, bounded by what agents do: ``ready_max_wait``.

        A restarted replica knows nothing of the sessions it had (a new pod has no state) and cannot tell "no
        agent serves this node" from "its agents have not redialled yet". Every live agent redials within its
        backoff cap (``gateway.backoff_max``, 30 s) plus one dial (``dial_timeout``, 10 s), so ``ready_max_wait``
        (45 s) bounds the wait. Earlier only when it knows what to expect: with Kubernetes, once every pool
        that has edge Nodes has a node reachable through an agent session (an agent registers its whole pool) and
        no new session came for ``ready_settle``. Without
        Kubernetes it waits the whole bound: a quiet moment says nothing about an agent still in its backoff.
        """
        sessions = len(self.registry.sessions)
        reachable = self.registry.reachable_nodes()
        status = f"{sessions} agent session(s), {len(reachable)} node(s)"
        now = time.monotonic()
        left = self.cfg.ready_max_wait - (now - self.started)
        if left <= 0:
            return True, status
        if not self.cfg.kubernetes.enabled:
            return False, (f"agents may still be reconnecting ({status}; ready_max_wait, the agents' reconnect "
                           f"bound, ends in {left:.0f}s)")
        missing = {n.pool for n in self.kube_nodes.values() if n.pool} - {e.pool for e in reachable}
        if missing:
            return False, (f"waiting for the agents of {len(missing)} pool(s) with edge Nodes, e.g. "
                           f"{sorted(missing)[0]!r} ({status}; at most {left:.0f}s more)")
        quiet = now - self.tunnel.last_session_at
        if quiet < self.cfg.ready_settle:
            return False, f"agents still connecting ({status}; last {quiet:.1f}s ago)"
        return True, status

    def _reevaluated(self, outcomes: list[Reevaluation]) -> None:
        """Registrations evaluated again: refusals counted, every agent told what it holds now."""
        for agent_session, accepted, refused in outcomes:
            self.tunnel.answer_register(agent_session, accepted, refused)

    def edge_names(self) -> list[str]:
        """The one source of truth for DNS: every known node of a tunnel pool (and, in Kubernetes, every such Node).

        Names the name rule refuses (the cluster's own, or names that read as addresses) never reach DNS,
        whatever a Node is called: the publisher sorts them and applies :meth:`edge_names_allowed` in its worker
        thread; this runs on the event loop, so it only copies the names out (in no order, maybe twice).
        Nodes of direct and layer3 pools are left to the cluster's own resolution (or, with ``hosts.direct:
        internal-ip``, mapped to their own addresses by the publisher).
        """
        nodes = list(self.registry.nodes.values())
        kube = list(self.kube_nodes.values())
        pools = {e.pool for e in nodes} | {n.pool for n in kube if n.pool}
        tunnelled = {pool: self.pools.tunnelled(pool) for pool in pools}  # once per pool, not per node
        names = [e.name for e in nodes if tunnelled[e.pool]]
        names += [n.name for n in kube if not n.pool or tunnelled[n.pool]]
        return names

    def _registry_changed(self) -> None:
        """A registration or a departure: the hosts file is published again, and the ops views are made again."""
        self.hosts.changed()
        self.ops_api.views.changed()

    def edge_names_allowed(self, valid: list[str]) -> list[str]:
        """The names of ``valid`` the name rule allows; run in the hosts publisher's worker thread: it reads one
        attribute and the rule, which is never changed in place (a configuration reload replaces it whole)."""
        return self.registry.names.publishable(valid)

    # ------------------------------------------------------------ Kubernetes

    async def start_kubernetes(self) -> None:
        from raven.kube import ConfigMapPublisher, LeaseElector, NodeWatcher, api_client, leader_sink

        k = self.cfg.kubernetes
        self._kube_api = await api_client(k.kubeconfig)

        def on_nodes(nodes: dict[str, KubeNode]) -> None:
            self.kube_nodes = nodes
            self.pools.set_kube_nodes(nodes)
            self._reevaluated(self.registry.set_authority({n.name: n.pool for n in nodes.values()}))
            self.kube_synced = True
            self.hosts.changed()

        # Until the first Node list arrives, no registration is accepted: Kubernetes is the authority.
        # Registrations refused meanwhile are re-evaluated (and the agents told) once it arrives.
        self.registry.authority = {}
        watcher = NodeWatcher(self._kube_api, k.pool_label, k.node_selector, on_change=on_nodes)
        self._background.append(asyncio.get_running_loop().create_task(watcher.run(), name="node-watcher"))
        target = self.cfg.hosts.configmap
        if target is not None:
            lease = self.cfg.hosts.lease
            self._elector = elector = LeaseElector(
                self._kube_api, lease.namespace, lease.name, self.cfg.replica_id, lease.duration,
                on_change=lambda leader: self.hosts.changed(),
            )
            for shard in range(self.cfg.hosts.shards):  # shard k >= 1 in ConfigMap <name>-<k>
                name = target.name if shard == 0 else f"{target.name}-{shard}"
                publisher = ConfigMapPublisher(self._kube_api, target.namespace, name, target.key)
                self.hosts.sinks.append((f"ConfigMap {target.namespace}/{name}", shard,
                                         leader_sink(elector, publisher)))
            self._background.append(asyncio.get_running_loop().create_task(elector.run(), name="lease"))
        log.info("watching edge Nodes (label %s%s)", k.pool_label, f", selector {k.node_selector}" if k.node_selector
                 else "")

    async def start(self) -> None:
        gcpause.settle_at_start()  # the full walk now, before any traffic
        if self.layer3 is not None:
            await self.layer3.start()  # before the tunnel port takes sessions that announce CIDRs
        # The TLS handshake and the upgrade request each have handshake_timeout (the guard), then HELLO too.
        # A low-level server with one path rather than an Application: every session's handler stays suspended
        # for the session's life, and the router, the middleware chain and their frames would stay with it.
        self.tunnel.guard = self.tunnel_guard  # the handler tells the guard itself (no wrapper per session)
        tunnel_server = web.Server(self.tunnel.handle)
        tunnel_runner = web.ServerRunner(tunnel_server, access_log=None, shutdown_timeout=2.0)
        await tunnel_runner.setup()
        self._runners.append(tunnel_runner)
        host, port = split_host_port(self.cfg.tunnel.listen)
        await GuardedSite(tunnel_runner, host, port, self.tunnel_guard, ssl_context=self.reloader.listener).start()

        front_runner = front_server(self.cfg.front, self.front_guard, self.proxy.handle, lambda: self.draining)
        await front_runner.setup()
        self._runners.append(front_runner)
        for listen in (self.cfg.front.listen, *self.cfg.front.also_listen):
            host, port = split_host_port(listen)
            site = GuardedSite(front_runner, host, port, self.front_guard,
                               ssl_context=self.front_reloader.listener if self.front_reloader else None)
            await site.start()
            self._front_sites.append(site)
        log.log(*self.auth.describe(self.front_reloader is not None, self.cfg.front.auth.mode, self.cfg.front.listen))

        self._runners.append(
            await start_ops_server(
                self.cfg.metrics_listen, self.metrics.registry, self.ready,
                self.ops_api.routes(),
                authorize=self.ops_api.authorize,  # open while no tokens are configured (a reload may add them)
            )
        )
        # The views a registration changes are made again soon after it, not at the next read (gateway/views.py).
        self._background.append(asyncio.get_running_loop().create_task(self.ops_api.views.run(), name="views"))
        self.reloader.start()
        if self.front_reloader is not None:
            self.front_reloader.start()
        if self.config_reloader is not None:
            self.config_reloader.start()
        if self.cfg.kubernetes.enabled:
            await self.start_kubernetes()
        if self.hosts.sinks:
            self.hosts.start()
        await self.tunnel.backfill.start()  # says why it is off when it is
        log.info(
            "gateway %s (%s%s) up: tunnel wss://%s%s, front end %s (ports %s), metrics %s",
            self.cfg.replica_id, version.describe(),
            f", agents from release {self.cfg.tunnel.min_agent_version}" if self.cfg.tunnel.min_agent_version else "",
            self.cfg.tunnel.listen, self.cfg.tunnel.path, self.cfg.front.listen,
            ",".join(map(str, self.cfg.front.allowed_ports)), self.cfg.metrics_listen,
        )

    async def drain(self) -> None:
        """Stop being ready, stop admitting, let everything in flight finish, and only then close sessions.

        1. ``/readyz`` says 503, agents are told (DRAIN), new tunnels are refused; every front-end answer from
           now on carries ``Connection: close`` and keep-alive connections waiting for their next request are
           closed once quiet (one whose request has begun to arrive is answered first: ConnectionGuard.drain),
           so clients reconnect through the Service, to another replica once it has taken this one out. (A
           request still on the wire as that close leaves gets no byte back; Go's HTTP client, so
           Prometheus's, sends an idempotent request again on a new connection then.)
        2. For ``drain_linger`` new connections are still served, one request each, while the Service removes
           this replica from its endpoints; then the front listeners refuse new connections.
        3. Up to ``drain_grace`` for every front connection to finish its request and close.
        4. Then the agent sessions close: nothing in flight is cut, nothing new can arrive.
        """
        log.info("draining: /readyz now 503, answers close their connections; new connections taken for %.1fs "
                 "more, then up to %.0fs for requests in flight", self.cfg.drain_linger, self.cfg.drain_grace)
        self.tunnel.start_drain()
        closed = self.front_guard.drain()
        await asyncio.sleep(self.cfg.drain_linger)
        for site in self._front_sites:
            await site.stop_accepting()
        closed += self.front_guard.drain()
        log.info("draining: front end takes no new connection (%d quiet keep-alive connection(s) closed, %d still "
                 "open, %d request(s) in flight)", closed, self.front_guard.connections,
                 self.proxy.admission.node_streams.total)
        try:
            async with asyncio.timeout(self.cfg.drain_grace):
                await self.front_guard.wait_empty()
                await self.proxy.idle.wait()
        except TimeoutError:
            log.warning("drain grace over with %d front connection(s) and %d request(s) still in flight",
                        self.front_guard.connections, self.proxy.admission.node_streams.total)
        self._stopped.set()

    async def stop(self) -> None:
        tunnels = [s.session for s in self.registry.sessions.values()]
        await asyncio.gather(*(t.close("gateway stopping", wire.ResetCode.DRAINING) for t in tunnels),
                             return_exceptions=True)
        await self.reloader.stop()
        if self.front_reloader is not None:
            await self.front_reloader.stop()
        if self.config_reloader is not None:
            await self.config_reloader.stop()
        await self.hosts.stop()
        await self.tunnel.backfill.stop()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._elector is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(3):
                    await self._elector.release()
        if self._kube_api is not None:
            await self._kube_api.close()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self.layer3 is not None:
            await self.layer3.close()
        logsafe.remove_secrets(self._log_secrets)
        gcpause.stop_settling()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        drain_task: list[asyncio.Task[None]] = []
        with StopSignals(lambda: drain_task.append(loop.create_task(self.drain()))) as signals:
            try:
                await self.start()
            except BaseException:
                if self.layer3 is not None:  # the device, its routes and the sysctls go even when start fails
                    await self.layer3.close()
                raise
            signals.started()
            try:
                await self._stopped.wait()
            finally:
                await self.stop()
        log.info("gateway %s stopped", self.cfg.replica_id)
        return 0
