"""`raven agent`: dial the gateway, register this pool's nodes, serve streams, drain on SIGTERM.

The wiring of the agent: one session from dial to end (handshake, registration, serving its streams), the
pool's nodes (static and from Kubernetes), reload and drain. Which links to the gateway exist and when each
dials again is agent/dialler.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp

from agent.backfill import Backfill
from agent.checks import Policy
from agent.controlhandlers import GatewayControl
from agent.dialler import Dialler, DuplicateReplica, Stopping
from agent.forwarder import Forwarder
from agent.layer3 import AgentLayer3
from agent.targets import DialTarget
from raven import pki, version
from raven.config import AgentConfig
from raven.config.agent import RESTART_ONLY as AGENT_RESTART_ONLY
from raven.config.reload import Reloader, take_over
from raven.lograte import RateLimitedLog
from raven.ops import gcpause
from raven.ops.fdlimit import AGENT_FD_OVERHEAD, check_descriptors
from raven.ops.metrics import AgentMetrics, set_cert_expiry
from raven.ops.server import OPS_LIMITS, start_ops_server
from raven.protocol import wire
from raven.stopsignals import StopSignals
from raven.transport import wsupgrade
from raven.transport.connect import connect
from raven.transport.stream import Stream
from raven.transport.tls import CertReloader, expiries
from raven.transport.tunnel import Tunnel
from raven.transport.wslink import WsLink

if TYPE_CHECKING:
    from raven.kube import KubeNode

log = logging.getLogger("raven.agent")


class Agent:
    def __init__(self, cfg: AgentConfig, load: Callable[[], AgentConfig] | None = None,
                 config_path: Path | None = None) -> None:
        self.cfg = cfg
        self.config_reloader = (Reloader(load, self.apply_config, config_path, cfg.config_watch_interval)
                                if load is not None else None)
        self.metrics = AgentMetrics()
        self._log = RateLimitedLog(log)  # lines a gateway's messages cause: per replica and kind
        ident = pki.load_identity(cfg.tls.cert)
        self.name = cfg.name or ident.agent or ident.common_name
        allowed = ", ".join(ident.pools) or "none"
        if not ident.pools:
            raise pki.PKIError(
                f"certificate {cfg.tls.cert} ({ident.role}) names no pool: an agent needs a certificate issued with "
                "'raven certs issue agent NAME --pool POOL'"
            )
        problem = ident.names_problem()
        if problem:  # the gateway would refuse every session: say so at start, once
            raise pki.PKIError(f"certificate {cfg.tls.cert}: {problem}, so the gateway refuses it; issue one with "
                               "'raven certs issue agent NAME --pool POOL'")
        if cfg.pool is None:
            if len(ident.pools) != 1:
                raise pki.PKIError(f"pool: not set, and certificate {cfg.tls.cert} names {len(ident.pools)} pools "
                                   f"({allowed}): set the pool this agent serves")
            self.pool: str = ident.pools[0]
        elif cfg.pool not in ident.pools:
            raise pki.PKIError(f"pool {cfg.pool!r} is not in certificate {cfg.tls.cert} (it allows: {allowed})")
        else:
            self.pool = cfg.pool
        self.reloader = CertReloader(
            cfg.tls, server=False,
            on_loaded=lambda tls: set_cert_expiry(self.metrics.cert_expiry, expiries(tls, "agent")),
        )
        self.sessions: set[Tunnel] = set()
        self.replica_sessions: dict[str, Tunnel] = {}
        self.dialler = Dialler(cfg.gateway, self._connect_once, self.metrics, lambda: len(self.replica_sessions),
                               self._log)
        self.draining = False
        self._static_nodes = {n.name: n.address for n in cfg.nodes}
        self._kube_nodes: dict[str, str] = {}  # this pool's Node objects: name -> address
        self._kube_synced = asyncio.Event()
        self._nodes = dict(self._static_nodes)
        self.forwarder = Forwarder(
            nodes=lambda: self._nodes,
            policy=Policy(frozenset(cfg.allowed_ports), frozenset(cfg.allowed_methods), cfg.allow_connect,
                          cfg.request_timeout),
            metrics=self.metrics,
            connect_timeout=cfg.connect_timeout,
            connections_per_node=cfg.upstream_connections_per_node,
            draining=lambda: self.draining,
            pool=self.pool,
            client_share=cfg.upstream_client_share,
            idle_timeout=cfg.upstream_idle_timeout,
            max_connections=self._upstream_cap(cfg),
            on_grown=gcpause.settle_soon,  # keep-alive connections to nodes are long-lived: frozen out of the GC's way
        )
        self.forwarder.compress_mode = cfg.compress
        # Scrapes kept through an outage (agent/backfill.py): scraping while no session is up (not when stopping).
        connected = lambda: self.draining or any(self._heard(s) for s in self.sessions)  # noqa: E731
        self.backfill = (Backfill(cfg.backfill, self.forwarder, self.metrics, connected) if cfg.backfill.enabled
                         else None)
        self.layer3 = AgentLayer3(cfg.layer3, self.pool, self.metrics) if cfg.layer3.enabled else None
        self.limits = wire.Limits(max_frame=cfg.limits.max_frame)
        self.refused: dict[str, str] = {}  # node -> why the gateway refused it (the latest answers)
        self.control = GatewayControl(self.refused, self.metrics, self.layer3, self._log)

    def apply_config(self, new: AgentConfig) -> None:
        """Take over a reloaded configuration without dropping a session: the node list (re-registered),
        allowlists, timeouts and upstream limits; the rest waits for a restart (and a warning says so)."""
        taken = take_over(self.cfg, new, AGENT_RESTART_ONLY, log)
        if taken is None:
            return
        cfg, changed = taken
        self.cfg = cfg
        self.forwarder.configure(
            Policy(frozenset(cfg.allowed_ports), frozenset(cfg.allowed_methods), cfg.allow_connect,
                   cfg.request_timeout),
            cfg.connect_timeout, cfg.upstream_connections_per_node, cfg.upstream_client_share,
            cfg.upstream_idle_timeout, self._upstream_cap(cfg),
        )
        self.forwarder.compress_mode = cfg.compress
        self._static_nodes = {n.name: n.address for n in cfg.nodes}
        self._set_nodes()
        logging.getLogger().setLevel(cfg.log_level.upper())
        log.info("configuration reload: took over %s", ", ".join(changed))

    def _upstream_cap(self, cfg: AgentConfig) -> int:
        """The cap on connections to nodes that the open-files limit allows (it says at start when that is less)."""
        check = check_descriptors("agent", {
            "upstream_max_connections": cfg.upstream_max_connections,
            "the ops listener": OPS_LIMITS.max_connections,
            "tunnel sessions, Kubernetes, files": AGENT_FD_OVERHEAD,
        })
        cap = min(cfg.upstream_max_connections, check.available(reserve=OPS_LIMITS.max_connections + AGENT_FD_OVERHEAD))
        if cap < cfg.upstream_max_connections:
            log.warning("until then, this agent holds at most %d connections to nodes (upstream_max_connections %d)",
                        cap, cfg.upstream_max_connections)
        nodes = len(cfg.nodes)
        if nodes and 2 * nodes > cap:
            log.info("%d static node(s) and a cap of %d connections to nodes: idle keep-alive connections will be "
                     "recycled (a Prometheus HA pair keeps about 2 per node; raise upstream_max_connections to keep "
                     "them)", nodes, cap)
        return cap

    def ready(self) -> tuple[bool, str]:
        """Ready while it holds a session to every gateway replica it dials, not merely to one.

        A rolling restart of a pool's agents stops the next one once this one is ready: had it reached one
        replica only, the others would be left without an agent of the pool.
        """
        if self.draining:
            return False, "draining"
        if not self.sessions:
            return False, "no session to any gateway"
        wanted = self.dialler.wanted
        if len(self.sessions) < wanted:
            claimed = self.dialler.replicas_claimed
            over = f" (the gateway claims {claimed}; gateway.max_replicas)" if claimed > wanted else ""
            return False, f"sessions to {len(self.sessions)} of {wanted} gateway replica(s){over}"
        return True, f"{len(self.sessions)} session(s) up"

    def set_kube_nodes(self, nodes: dict[str, KubeNode]) -> None:
        """The pool's Node objects changed: serve them (plus the static list) and re-register everywhere."""
        self._kube_nodes = {n.name: n.addresses[0] for n in nodes.values() if n.pool == self.pool and n.addresses}
        first = not self._kube_synced.is_set()
        self._kube_synced.set()
        self._set_nodes(force=first)

    def _set_nodes(self, force: bool = False) -> None:
        """Serve the Node objects' nodes plus the static list; when that changed, re-register everywhere."""
        merged = {**self._kube_nodes, **self._static_nodes}
        if merged == self._nodes and not force:
            return
        log.info("pool %s now has %d node(s) (%d from Node objects)", self.pool, len(merged), len(self._kube_nodes))
        self._nodes = merged
        gcpause.settle_soon()
        if self.cfg.kubernetes.enabled and not self._kube_synced.is_set():
            return  # the first REGISTER waits for the Node list (a partial list would withdraw nodes)
        register = wire.Register(self.node_infos())
        self.refused.clear()
        self.metrics.nodes_refused.set(0)
        for session in list(self.sessions):
            session.send_control(register)

    async def watch_kubernetes(self) -> None:
        from raven.errors import KubeError
        from raven.kube import NodeWatcher, api_client

        k = self.cfg.kubernetes
        try:
            api = await api_client(k.kubeconfig)
        except KubeError as exc:
            log.error("cannot watch Nodes, serving only the static node list: %s", exc)
            return
        try:
            selector = ",".join(p for p in (f"{k.pool_label}={self.pool}", k.node_selector) if p)
            watcher = NodeWatcher(api, k.pool_label, selector, on_change=self.set_kube_nodes)
            await watcher.run()
        finally:
            await api.close()

    def node_infos(self) -> tuple[wire.NodeInfo, ...]:
        return tuple(wire.NodeInfo(name, addr, self.pool) for name, addr in sorted(self._nodes.items()))

    # ------------------------------------------------------------ one session

    async def _connect_once(self, http: aiohttp.ClientSession, target: DialTarget, key: str = "") -> bool:
        """Dial, handshake and serve one session. Returns True if the handshake succeeded."""
        gw = self.cfg.gateway
        lim = self.cfg.limits
        # A fresh id per connection: the gateway replaces a session only on a reconnect of that very
        # connection, so a duplicate connection to a replica never displaces the live session there.
        session_id = uuid.uuid4().hex
        async with asyncio.timeout(gw.dial_timeout):
            ws = await http.ws_connect(
                target.url,
                ssl=self.reloader.current,
                server_hostname=target.server_hostname,
                compress=0,
                # This machine's clock, which the gateway compares with its own (raven check: clock skew).
                headers={"Date": email.utils.formatdate(usegmt=True)},
            )
        hello = wire.Hello(self.name, session_id, wire.SUPPORTED_VERSIONS, lim.window, lim.max_streams_per_session,
                           release=version.RELEASE)
        link: WsLink | None = None
        try:
            # From the 101 on, the connection's bytes are the link's (raven/transport/wslink.py), not aiohttp's.
            link = wsupgrade.take_over(ws, max_message=lim.max_frame)
            session, welcome = await connect(link, hello, limits=self.limits, timeout=lim.handshake_timeout)
            link.drain_timeout = (Tunnel.WRITE_STALL_TIMEOUTS + 1) * session.core.heartbeat_timeout
            if self.draining:
                raise Stopping("agent is stopping: not starting a new session")
            if welcome.replica in self.replica_sessions:
                raise DuplicateReplica(
                    f"connection via {target.key} reached replica {welcome.replica!r}, which this agent already "
                    f"holds a session to"
                )
            self.metrics.connects.labels("ok").inc()
            self.dialler.replicas_reported(welcome.replicas)
            with self.dialler.live(key):
                await self._serve(link, session, hello, welcome)
            return True
        finally:
            if link is not None:
                await link.close()  # the close handshake; then aiohttp's close only releases the connection
            await ws.close()

    @staticmethod
    def _heard(session: Tunnel) -> bool:
        """The gateway was heard lately (its PINGs come every heartbeat interval): a session silent for longer is
        likely cut, and the outage scraper starts before the heartbeat deadline ends it (docs/backfill.md)."""
        core = session.core
        return session.loop.time() - core.last_rx < 1.5 * core.heartbeat_interval + 0.5

    def _on_open(self, stream: Stream) -> None:
        if stream.open.kind == wire.StreamKind.BACKFILL:
            if self.backfill is None:
                stream.reset(wire.ResetCode.REFUSED, "backfill is off on this agent (backfill.enabled)")
            else:
                self.backfill.on_open(stream)
            return
        self.forwarder.on_open(stream)

    async def _serve(self, link: WsLink, session: Tunnel, hello: wire.Hello,
                     welcome: wire.Welcome) -> None:
        session.on_open = self._on_open
        self.control.attach(session, welcome.replica)
        if self._kube_synced.is_set() or not self.cfg.kubernetes.enabled:
            # With Kubernetes, the first REGISTER waits for the Node list (set_kube_nodes sends it):
            # a partial list would withdraw nodes the pool still has.
            session.send_control(wire.Register(self.node_infos()))
        self.sessions.add(session)
        self.replica_sessions[welcome.replica] = session
        if self.layer3 is not None:
            self.layer3.attach(session)
        self.metrics.sessions.set(len(self.sessions))
        gcpause.settle_soon()
        log.info(
            "connected to gateway replica %s (%d replica(s), release %s, protocol %d), session %s, registering %d "
            "node(s) of pool %s", welcome.replica, welcome.replicas, version.peer_release(welcome.release),
            welcome.version, hello.session[:8], len(self._nodes), self.pool,
        )
        try:
            await link.serve(session)
        finally:
            if self.layer3 is not None:
                self.layer3.detach(session)
            self.sessions.discard(session)
            if self.replica_sessions.get(welcome.replica) is session:
                del self.replica_sessions[welcome.replica]
            self.metrics.sessions.set(len(self.sessions))
            gcpause.settle_soon()
            # Ending because this agent or that gateway is draining is the normal way: INFO, not WARNING.
            expected = self.draining or session.core.peer_draining
            log.log(logging.INFO if expected else logging.WARNING, "session to gateway %s ended: %s",
                    welcome.replica, session.close_reason)

    # ------------------------------------------------------------ lifecycle

    async def drain_and_stop(self) -> None:
        if self.draining:
            return
        self.draining = True
        log.info("draining: telling gateways, waiting up to %.0fs for %d stream(s) in flight",
                 self.cfg.drain_grace, len(self.forwarder.tasks))
        for s in list(self.sessions):
            s.send_control(wire.Drain("agent is stopping"))
        idle = await self.forwarder.wait_idle(self.cfg.drain_grace)
        if not idle:
            log.warning("drain grace over with %d stream(s) still in flight: cancelling them",
                        len(self.forwarder.tasks))
        self.dialler.stop()
        for s in list(self.sessions):
            await s.close("agent stopped", wire.ResetCode.DRAINING)

    async def _until_stopped(self, signals: StopSignals, stopping: Callable[[], asyncio.Task[None] | None]) -> None:
        """From the start of the dialler to its end (and the drain's, when a signal stopped it)."""
        loop = asyncio.get_running_loop()
        self.reloader.start()
        if self.config_reloader is not None:
            self.config_reloader.start()
        host = urlsplit(self.cfg.gateway.url).hostname
        log.info("agent %s (pool %s, %s) starting: gateway %s, %d node(s), ports %s", self.name, self.pool,
                 version.describe(), host, len(self._nodes), ",".join(map(str, self.cfg.allowed_ports)))
        kube_task = loop.create_task(self.watch_kubernetes()) if self.cfg.kubernetes.enabled else None
        backfill_task = loop.create_task(self.backfill.run()) if self.backfill is not None else None
        signals.started()
        try:
            await self.dialler.run()
            if (stop_task := stopping()) is not None:
                await stop_task
        finally:
            for task in (kube_task, backfill_task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop_task: asyncio.Task[None] | None = None

        def on_stop() -> None:
            nonlocal stop_task
            stop_task = loop.create_task(self.drain_and_stop())

        with StopSignals(on_stop) as signals:
            gcpause.settle_at_start()  # the full walk now, before any traffic
            if self.layer3 is not None:
                await self.layer3.start()
            try:
                ops = await start_ops_server(self.cfg.metrics_listen, self.metrics.registry, self.ready)
            except BaseException:
                if self.layer3 is not None:
                    await self.layer3.close()
                raise
            try:
                await self._until_stopped(signals, lambda: stop_task)
            finally:
                await self.forwarder.close()
                await self.reloader.stop()
                if self.config_reloader is not None:
                    await self.config_reloader.stop()
                await ops.cleanup()
                if self.layer3 is not None:
                    await self.layer3.close()
                gcpause.stop_settling()
        log.info("agent %s stopped", self.name)
        return 0
