"""`raven agent`: dial the gateway, register this pool's nodes, serve streams, drain on SIGTERM.

Size: the wiring of the agent (dial loops per replica, sessions, registration, Kubernetes, reload, drain).

Why this module is long and not split: the dial loops, sessions and registrations share the agent's one
view of its replicas; the dialler moving out is part of issue 22's refactor.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import random
import signal
import ssl
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp

from agent.checks import Policy
from agent.control import GatewayControl
from agent.forwarder import Forwarder
from agent.layer3 import AgentLayer3
from agent.targets import DialTarget, Resolution, resolve
from raven import pki, version
from raven.config import AgentConfig
from raven.config.reload import Reloader, take_over
from raven.errors import RavenError
from raven.lograte import RateLimitedLog
from raven.ops import gcpause
from raven.ops.fdlimit import AGENT_FD_OVERHEAD, check_descriptors
from raven.ops.metrics import AgentMetrics, set_cert_expiry
from raven.ops.server import OPS_LIMITS, start_ops_server
from raven.protocol import wire
from raven.protocol.handshake import HandshakeRefused
from raven.refusals import Reason
from raven.transport.connect import connect
from raven.transport.session import Session
from raven.transport.tls import CertReloader, expiries
from raven.transport.websocket import messages

if TYPE_CHECKING:
    from raven.kube import KubeNode

log = logging.getLogger("raven.agent")


class DuplicateReplica(RavenError):
    """This connection reached a replica the agent already holds a session to."""


def full_jitter(attempt: int, initial: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, initial * 2**attempt)]."""
    return rng.uniform(0, min(cap, initial * (2 ** min(attempt, 30))))


# Settings a running agent cannot take over: its identity, where it dials, its listeners and wire limits.
AGENT_RESTART_ONLY = ("name", "pool", "gateway", "metrics_listen", "tls", "limits", "kubernetes",
                      "config_watch_interval")


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
        self.sessions: set[Session] = set()
        self.replica_sessions: dict[str, Session] = {}
        self.replicas_expected = 1
        self._links: dict[str, asyncio.Task[None]] = {}
        self._links_changed = asyncio.Event()
        self._live_links: set[str] = set()  # links that hold a session now
        self._retiring: set[str] = set()  # links to end once their session ends
        self.draining = False
        self._stop = asyncio.Event()
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
        )
        self.forwarder.compress_mode = cfg.compress
        self.layer3 = AgentLayer3(cfg.layer3, self.pool, self.metrics) if cfg.layer3.enabled else None
        self.limits = wire.Limits(max_frame=cfg.limits.max_frame)
        self._rng = random.Random()
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
        wanted = max(len(self._links), self.replicas_expected)
        if len(self.sessions) < wanted:
            return False, f"sessions to {len(self.sessions)} of {wanted} gateway replica(s)"
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
                max_msg_size=lim.max_frame + 1,  # aiohttp's limit is exclusive; the wire decoder's is not
                compress=0,
                autoping=True,
                autoclose=True,
            )
        hello = wire.Hello(self.name, session_id, wire.SUPPORTED_VERSIONS, lim.window, lim.max_streams_per_session,
                           release=version.RELEASE)
        try:
            session, welcome = await connect(ws, hello, limits=self.limits, timeout=lim.handshake_timeout)
            if self.draining:
                raise HandshakeRefused(Reason.AGENT_STOPPING, "agent is stopping: not starting a new session")
            if welcome.replica in self.replica_sessions:
                raise DuplicateReplica(
                    f"connection via {target.key} reached replica {welcome.replica!r}, which this agent already "
                    f"holds a session to"
                )
            self.metrics.connects.labels("ok").inc()
            if welcome.replicas != self.replicas_expected:
                log.info("gateway reports %d replica(s) (was %d)", welcome.replicas, self.replicas_expected)
                self.replicas_expected = welcome.replicas
                self._links_changed.set()
            self._live_links.add(key)
            try:
                await self._serve(ws, session, hello, welcome)
            finally:
                self._live_links.discard(key)
            return True
        finally:
            await ws.close()

    async def _serve(self, ws: aiohttp.ClientWebSocketResponse, session: Session, hello: wire.Hello,
                     welcome: wire.Welcome) -> None:
        session.on_open = self.forwarder.on_open
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
            await session.run(messages(ws))
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

    # ------------------------------------------------------------ dial loops

    async def _link(self, http: aiohttp.ClientSession, target: DialTarget, key: str) -> None:
        """Hold one session through ``target``, redialling with backoff and full jitter."""
        attempt = 0
        gw = self.cfg.gateway
        while not self._stop.is_set():
            cut = False
            try:
                if await self._connect_once(http, target, key):
                    attempt = 0
            except DuplicateReplica as exc:
                self.metrics.connects.labels("duplicate").inc()
                log.info("%s; dialling again", exc)
            except HandshakeRefused as exc:
                self.metrics.connects.labels("refused").inc()
                log.error("%s", exc)
            except (aiohttp.ClientError, OSError, TimeoutError, ssl.SSLError) as exc:
                cut = unreachable(exc)
                if cut:  # every unreachable_retry for as long as the uplink is out: once a minute in the log
                    self.metrics.connects.labels("unreachable").inc()
                    self._log.log(logging.WARNING, target.key, "unreachable", "cannot reach gateway %s: %s",
                                  target.url, _describe(exc))
                else:
                    self.metrics.connects.labels("failed").inc()
                    log.warning("cannot reach gateway %s: %s", target.url, _describe(exc))
            if self._stop.is_set():
                break
            if key in self._retiring:  # its address left DNS while the session lived: do not redial
                self._retiring.discard(key)
                if self._links.get(key) is asyncio.current_task():
                    del self._links[key]
                log.info("gateway target %s retired", key)
                return
            if cut:
                # The dial reached nobody: there is no gateway load to spare, so no growing backoff (attempt
                # stays): the next dial comes soon, and a returning uplink is found within seconds.
                delay = self._rng.uniform(min(gw.backoff_initial, gw.unreachable_retry), gw.unreachable_retry)
                log.debug("reconnecting to %s in %.2fs (gateway unreachable)", target.key, delay)
            else:
                delay = full_jitter(attempt, gw.backoff_initial, gw.backoff_max, self._rng)
                attempt += 1
                log.info("reconnecting to %s in %.2fs (attempt %d)", target.key, delay, attempt)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stop.wait()

    async def _resolve_unless_stopping(self) -> Resolution | None:
        """Resolve the gateway's name; a drain does not wait for a slow DNS server (None then)."""
        gw = self.cfg.gateway
        lookup = asyncio.ensure_future(resolve(gw.url, gw.server_name, gw.resolver))
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({lookup, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not lookup.done():
            lookup.cancel()
            with contextlib.suppress(BaseException):
                await lookup
            return None
        return lookup.result()

    def _desired(self, res: Resolution) -> dict[str, DialTarget]:
        if res.per_address:
            return {t.key: t for t in res.targets}
        target = res.targets[0]
        return {f"{target.key}#{i}": target for i in range(1, max(1, self.replicas_expected) + 1)}

    async def dial_forever(self) -> None:
        """Keep one link per gateway address (or per replica behind one address); follow DNS changes."""
        gw = self.cfg.gateway
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        res: Resolution | None = None
        # The TCP connect has its own, shorter deadline: one that fails tells a cut uplink from a slow gateway.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(gw.connect_timeout, gw.dial_timeout))
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            try:
                while not self._stop.is_set():
                    try:
                        res = await self._resolve_unless_stopping() or res
                    except OSError as exc:
                        log.warning("cannot resolve the gateway: %s%s", exc,
                                    " (keeping the current links)" if res else "")
                    if res is not None:
                        self._apply(http, self._desired(res))
                    self._links_changed.clear()
                    # Jittered, so that agents started together do not re-resolve in lockstep; faster while
                    # fewer replicas are held than the gateway says exist (a new replica is found sooner).
                    short = res is None or len(self.replica_sessions) < self.replicas_expected
                    base = min(gw.resolve_interval, 5.0) if short else gw.resolve_interval
                    interval = base * self._rng.uniform(0.8, 1.2)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(interval):
                            stop = asyncio.ensure_future(self._stop.wait())
                            changed = asyncio.ensure_future(self._links_changed.wait())
                            try:
                                await asyncio.wait({stop, changed}, return_when=asyncio.FIRST_COMPLETED)
                            finally:
                                stop.cancel()
                                changed.cancel()
            finally:
                tasks = list(self._links.values())
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self._links.clear()

    def _apply(self, http: aiohttp.ClientSession, desired: dict[str, DialTarget]) -> None:
        for key in list(self._links):
            if key in desired:
                self._retiring.discard(key)
            elif key in self._live_links:
                # Never cut a live session because DNS changed (a partial answer, a scale-down in
                # progress): it ends on its own (drain, GOAWAY) and the link then stops redialling.
                if key not in self._retiring:
                    log.info("gateway target %s left DNS: keeping its live session, not redialling after", key)
                    self._retiring.add(key)
            else:
                log.info("gateway target %s left DNS: closing its link", key)
                self._links.pop(key).cancel()
        for key, target in desired.items():
            task = self._links.get(key)
            if task is None or task.done():
                log.info("dialling gateway target %s (%s)", key, target.url)
                self._links[key] = asyncio.get_running_loop().create_task(self._link(http, target, key), name=key)

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
        self._stop.set()
        for s in list(self.sessions):
            await s.close("agent stopped", wire.ResetCode.DRAINING)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        gcpause.install()
        gcpause.settle_soon()
        if self.layer3 is not None:
            await self.layer3.start()
        try:
            ops = await start_ops_server(self.cfg.metrics_listen, self.metrics.registry, self.ready)
        except BaseException:
            if self.layer3 is not None:
                await self.layer3.close()
            raise
        self.reloader.start()
        if self.config_reloader is not None:
            self.config_reloader.start()
        stop_task: asyncio.Task[None] | None = None

        def on_signal() -> None:
            nonlocal stop_task
            if stop_task is None:
                stop_task = loop.create_task(self.drain_and_stop())

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        host = urlsplit(self.cfg.gateway.url).hostname
        log.info("agent %s (pool %s, %s) starting: gateway %s, %d node(s), ports %s", self.name, self.pool,
                 version.describe(), host, len(self._nodes), ",".join(map(str, self.cfg.allowed_ports)))
        kube_task = loop.create_task(self.watch_kubernetes()) if self.cfg.kubernetes.enabled else None
        try:
            await self.dial_forever()
            if stop_task is not None:
                await stop_task
        finally:
            if kube_task is not None:
                kube_task.cancel()
                with contextlib.suppress(BaseException):
                    await kube_task
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
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


_UNREACHABLE_ERRNOS = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.ETIMEDOUT})


def unreachable(exc: BaseException) -> bool:
    """The dial never reached the gateway: the TCP connect timed out or had no route (not a refusal, not TLS)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return True
    if isinstance(exc, aiohttp.ClientConnectorError):
        return exc.os_error.errno in _UNREACHABLE_ERRNOS or isinstance(exc.os_error, TimeoutError)
    return isinstance(exc, OSError) and not isinstance(exc, aiohttp.ClientError) and exc.errno in _UNREACHABLE_ERRNOS


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.WSServerHandshakeError):
        return f"handshake refused with HTTP {exc.status}: {exc.message}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        # With TLS 1.3 the gateway checks the client certificate after the client's side of the
        # handshake is done: a refused certificate shows here only as a closed connection.
        return ("the gateway closed the connection during the TLS/WebSocket handshake; if this repeats, it "
                "probably refused this agent's certificate (not signed by the gateway's CA, or expired): see the "
                "gateway's log")
    return str(exc) or repr(exc)
