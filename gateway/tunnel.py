"""The gateway's tunnel endpoint: mutual-TLS WebSocket, the gateway's admission of a HELLO (raven/transport/connect.py
runs the exchange), the agents' control frames (one table), registrations."""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import sys
import time
from collections import OrderedDict
from typing import NamedTuple

from aiohttp import web

from gateway.backfill import Backfill
from gateway.layer3 import GatewayLayer3
from gateway.registry import AgentSession, Registry, told
from raven import pki, version
from raven.aio import cancel_and_wait
from raven.config import GatewayConfig
from raven.http.guard import ConnectionGuard
from raven.lograte import RateLimitedLog
from raven.ops import gcpause
from raven.ops.client import parse_date
from raven.ops.metrics import GatewayMetrics
from raven.protocol import handshake, wire
from raven.protocol.control import ControlDispatcher
from raven.protocol.errors import RemoteProtocolError
from raven.refusals import HandshakeRefused, Reason, Refusal, handshake_reason
from raven.transport.connect import accept
from raven.transport.tunnel import Stream, Tunnel
from raven.transport.wslink import WsLink
from raven.transport.wsupgrade import TunnelResponse

log = logging.getLogger("raven.gateway.tunnel")


class Buckets:
    """Token buckets per key (an agent identity): ``rate`` per second after a ``burst``; the table is bounded."""

    def __init__(self, rate: float, burst: int, max_keys: int = 65536) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_keys = max_keys
        self._state: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def take(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens, at = self._state.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._state[key] = (tokens - 1.0 if ok else tokens, now)
        while len(self._state) > self.max_keys:
            self._state.popitem(last=False)  # forgetting a key only gives it a fresh burst
        return ok

    def wait(self, key: str, now: float | None = None) -> float:
        """Seconds until ``key`` has a token again."""
        now = time.monotonic() if now is None else now
        tokens, at = self._state.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        return max(0.0, (1.0 - tokens) / self.rate)


class Claim(NamedTuple):
    """What an agent's certificate lets it claim: its name, the pools it may serve, the CIDRs it may announce."""

    name: str
    common_name: str
    pools: frozenset[str]
    cidrs: tuple[str, ...]


MAX_CLOCK_OFFSET = 10 * 365 * 86400.0  # a Date further off than ten years is not a clock reading


def agent_clock_offset(date: str | None, now: float) -> float | None:
    """The agent's clock minus this gateway's, from the ``Date`` header of its upgrade request (agents
    send one; whole seconds, so the middle of that second is taken), or None: no header (an older agent), or not
    a date."""
    theirs = parse_date(date[:64] if date else None)
    if theirs is None or abs(theirs - now) > MAX_CLOCK_OFFSET:
        return None
    return round(theirs + 0.5 - now, 1)


class TunnelEndpoint:
    def __init__(self, cfg: GatewayConfig, registry: Registry, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.path = cfg.tunnel.path  # a listener setting: a reload does not move it
        self.draining = False
        self.limits = wire.Limits(max_frame=cfg.limits.max_frame)
        self.handlers: set[asyncio.Task[None]] = set()
        self.last_session_at = time.monotonic()
        # Since when this replica has held no agent session after having held some (None: it holds some, or
        # never had any since it started).
        self.empty_since: float | None = None
        self._log = RateLimitedLog(log)
        self.layer3: GatewayLayer3 | None = None  # set by the service when layer3.enabled
        # The tunnel port's connection guard (set by the service): told when a request starts and ends, here
        # rather than by a wrapping handler (raven/http/listener.py's guarded_handler), whose coroutine would
        # stay suspended beside this one for every session's life.
        self.guard: ConnectionGuard | None = None
        self.session_buckets = Buckets(cfg.session_rate, cfg.session_burst)
        self.register_buckets = Buckets(cfg.register_rate, cfg.register_burst)
        self.routes_buckets = Buckets(cfg.register_rate, cfg.register_burst)
        self.control = self._control_table()
        # Scrapes agents kept through an outage (gateway/backfill.py): one task beside each session.
        self.backfill = Backfill(cfg.backfill, registry, metrics.registry)

    def configure(self, cfg: GatewayConfig) -> None:
        """A reloaded configuration: caps and rates apply from the next handshake or registration on."""
        self.cfg = cfg
        for buckets, rate, burst in ((self.session_buckets, cfg.session_rate, cfg.session_burst),
                                     (self.register_buckets, cfg.register_rate, cfg.register_burst),
                                     (self.routes_buckets, cfg.register_rate, cfg.register_burst)):
            buckets.rate, buckets.burst = rate, float(burst)

    def tls_failed(self, exc: ssl.SSLError) -> None:
        """A TLS handshake on the tunnel port failed (called from the TLS layer, no peer address known).

        Counted as ``tls <code>``: the code is OpenSSL's reason code (``CERTIFICATE_VERIFY_FAILED``,
        ``HTTP_REQUEST``, ...), a fixed word from the library's own table, never text the peer sent, so the
        label set stays bounded (and cut to 40 characters). Logged like every line a peer can cause: once a
        minute for each reason, with a count of the ones held back (raven/lograte.py)."""
        reason = str(exc.reason or type(exc).__name__)
        self.metrics.handshake_failures.labels(f"tls {reason}"[:40]).inc()
        detail = getattr(exc, "verify_message", "") or reason
        hint = ""
        if reason == "CERTIFICATE_VERIFY_FAILED":
            hint = " (a client certificate not signed by this gateway's CA, or expired)"
        elif reason in ("HTTP_REQUEST", "WRONG_VERSION_NUMBER"):
            hint = " (plain HTTP or another protocol sent to the TLS tunnel port)"
        self._log.warning("tls", reason, "TLS handshake on the tunnel port failed: %s%s", detail, hint)

    def _refuse(self, peer: str, reason: Reason, text: str) -> web.Response:
        """Refuse the upgrade request itself: the answer has the reason's status and the text as its body."""
        self._log.warning(peer, reason.label, "tunnel handshake from %s refused: %s", peer, text)
        self.metrics.handshake_failures.labels(reason.label).inc()
        return web.Response(status=reason.status, text=text + "\n")

    def _identity(self, request: web.BaseRequest, peer: str) -> pki.Identity | web.Response:
        """The agent's identity from its client certificate, or the refusal to answer.

        A function of its own so that the certificate's bytes are not kept in the frame of the handler,
        which lives as long as the session.
        """
        ssl_obj = request.transport.get_extra_info("ssl_object") if request.transport else None
        der = ssl_obj.getpeercert(binary_form=True) if isinstance(ssl_obj, ssl.SSLObject) else None
        if not der:
            return self._refuse(peer, Reason.CLIENT_CERTIFICATE_REQUIRED, "client certificate required")
        try:
            ident = pki.identity_from_der(der)
        except pki.PKIError as exc:
            return self._refuse(peer, Reason.UNREADABLE_CLIENT_CERTIFICATE, f"unreadable client certificate: {exc}")
        if ident.role != "agent" or not ident.pools:
            return self._refuse(peer, Reason.NOT_AN_AGENT_CERTIFICATE,
                                f"certificate {ident.common_name[:80]!r} is not an agent certificate with pools")
        problem = ident.names_problem()  # a CA-signed name is checked by the rule node names follow
        if problem:
            return self._refuse(peer, Reason.INVALID_IDENTITY, f"agent certificate refused: {problem}")
        return ident

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """The tunnel port's only resource: ``GET`` (or ``HEAD``) on ``tunnel.path``; 404 and 405 elsewhere.

        The port is a low-level aiohttp server rather than an Application: this coroutine stays suspended for
        the session's life, and a router and middleware chain would keep their frames alive beside it (so would
        a wrapper that tells the guard: this coroutine tells it itself).
        """
        guard = self.guard
        if guard is not None:
            guard.request_started(request)
        try:
            if request.path != self.path:
                raise web.HTTPNotFound()
            if request.method not in ("GET", "HEAD"):
                raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
            peer = request.remote or "?"
            if self.draining:
                return self._refuse(peer, Reason.GATEWAY_DRAINING, "gateway is draining")
            ident = self._identity(request, peer)
            if not isinstance(ident, pki.Identity):
                return ident
            claim = Claim(ident.name, ident.common_name, frozenset(ident.pools), ident.cidrs)
            clock = agent_clock_offset(request.headers.get("Date"), time.time())
            del ident  # this frame lives as long as the session: keep the four fields, not the parsed certificate

            # aiohttp answers the Upgrade; from its 101 on, the connection's bytes are the link's
            # (transport/wslink.py).
            ws = TunnelResponse(max_message=self.cfg.limits.max_frame)
            await ws.prepare(request)
            task = asyncio.current_task()
            if task is not None:
                self.handlers.add(task)
            try:
                if ws.link is not None:
                    await self._serve(ws.link, claim, peer, clock)
            finally:
                if task is not None:
                    self.handlers.discard(task)
                if not ws.closed:
                    await ws.close()
            return ws
        finally:
            if guard is not None:
                guard.request_finished(request)

    def _admit(self, claim: Claim, peer: str, hello: wire.Hello) -> wire.Welcome:
        """The gateway's policy for one HELLO: the WELCOME, or :class:`HandshakeRefused` (GOAWAY with the reason)."""
        expected = claim.name
        if hello.agent != expected:
            raise HandshakeRefused(Reason.HELLO_AGENT_MISMATCH, f"HELLO names agent {hello.agent[:80]!r} but the "
                                   f"certificate is for {expected!r}", key=peer)
        cfg = self.cfg
        held = self.registry.agent_sessions(expected)
        if held >= cfg.max_sessions_per_agent:
            raise HandshakeRefused(Reason.AGENT_SESSION_CAP, f"agent {expected} already holds {held} sessions to "
                                   f"this gateway (limit {cfg.max_sessions_per_agent}, max_sessions_per_agent)",
                                   key=expected)
        if len(self.registry.sessions) >= cfg.max_sessions_total:
            raise HandshakeRefused(Reason.SESSION_CAP, f"this gateway holds {len(self.registry.sessions)} agent "
                                   f"sessions (limit {cfg.max_sessions_total}, max_sessions_total)", key=expected)
        if not self.session_buckets.take(expected):
            raise HandshakeRefused(Reason.SESSION_RATE, f"agent {expected} opens sessions too often (more than "
                                   f"{cfg.session_burst} at once, then {cfg.session_rate:g} per second): back off",
                                   key=expected)
        try:
            chosen = handshake.choose_version(hello.versions)
        except RemoteProtocolError as err:
            raise HandshakeRefused(handshake_reason(err.code), f"{err.text} (see docs/skew.md)", key=expected) from None
        too_old = self._release_refused(hello)
        if too_old:
            raise HandshakeRefused(Reason.AGENT_VERSION, too_old, key=expected)
        lim = cfg.limits
        return wire.Welcome(
            version=chosen,
            replica=cfg.replica_id,
            replicas=cfg.replicas,
            heartbeat_interval=lim.heartbeat_interval,
            heartbeat_timeout=lim.heartbeat_timeout,
            window=lim.window,
            max_streams=lim.max_streams_per_session,
            release=version.RELEASE,
        )

    def _refused(self, claim: Claim, peer: str, err: RemoteProtocolError | HandshakeRefused, answered: bool) -> None:
        """Log (rate-limited) and count a refused handshake; the label is the reason's, never the peer's text."""
        if isinstance(err, HandshakeRefused):
            label, key = err.label, err.key
        else:  # the core's code: the peer broke the handshake
            label, key = handshake_reason(err.code).label, ""
        if not answered:  # no HELLO came: nothing was said, nothing is counted
            self._log.warning(peer, label, "agent %s (%s): %s", claim.common_name, peer, err.text)
            return
        self._log.warning(key or peer, label, "closing tunnel: %s", err.text)
        self.metrics.handshake_failures.labels(label).inc()

    def _release_refused(self, hello: wire.Hello) -> str:
        """Why this agent's release is below ``tunnel.min_agent_version`` (empty: it is not)."""
        floor = self.cfg.tunnel.min_agent_version
        if floor is None or not version.older_than(hello.release, floor):
            return ""
        return (f"agent {hello.agent} runs release {version.peer_release(hello.release)}, older than this "
                f"gateway's tunnel.min_agent_version {floor}: upgrade the agent (supported releases: docs/skew.md)")

    async def _serve(self, ws: WsLink, claim: Claim, peer: str, clock: float | None) -> None:
        try:
            session, hello = await accept(ws, functools.partial(self._admit, claim, peer),
                                          functools.partial(self._refused, claim, peer), limits=self.limits,
                                          timeout=self.cfg.limits.handshake_timeout)
        except (RemoteProtocolError, HandshakeRefused):
            return
        ws.drain_timeout = (Tunnel.WRITE_STALL_TIMEOUTS + 1) * session.core.heartbeat_timeout  # after the session's
        pools = claim.pools
        session.on_stream_closed = self._stream_closed
        agent_session = AgentSession(hello.agent, hello.session, pools, session, peer=peer, cidrs=claim.cidrs,
                                     release=sys.intern(hello.release), clock_offset=clock)
        # Set before the first frame is read (session.run below); a partial costs less than a closure and its cells.
        session.on_control = functools.partial(self.control.dispatch, agent_session)
        if self.layer3 is not None:
            session.on_closing = functools.partial(self.layer3.detach, agent_session)
        self.last_session_at = time.monotonic()
        self.empty_since = None
        old = self.registry.add_session(agent_session)
        backfill: asyncio.Task[None] | None = None
        for pool in pools:
            self.metrics.sessions.labels(pool).inc()
        try:  # from here on, whatever happens (a cancel while the older session closes), the finally undoes it
            if old is not None:
                self._log.info(hello.agent, "replaced", "agent %s reconnected with session %s: closing the older "
                               "one", hello.agent, hello.session[:8])
                self._cancel_pending(old)
                await old.session.close("replaced by a newer connection of the same session")
            self._log.info(hello.agent, "connected", "agent %s connected from %s (session %s, pools %s, release %s, "
                           "protocol %d)", hello.agent, peer, hello.session[:8], ",".join(sorted(pools)),
                           version.peer_release(hello.release), session.core.version)
            if self.draining:
                session.send_control(wire.Drain("gateway is draining"))
            del hello, old  # this frame lives as long as the session (memory per idle session)
            if self.backfill.on:  # no task at all while backfill is off (memory per idle session)
                backfill = asyncio.get_running_loop().create_task(self.backfill.session(agent_session))
            await ws.serve(session)
        finally:
            if backfill is not None:
                await cancel_and_wait((backfill,))
            await session.close("the tunnel handler ended")  # idempotent: a no-op after run()
            self._cancel_pending(agent_session)
            if self.layer3 is not None:
                self.layer3.detach(agent_session)
            self.registry.remove_session(agent_session)
            if not self.registry.sessions:
                self.empty_since = time.monotonic()
            for pool in pools:
                self.metrics.sessions.labels(pool).dec()
            self._update_gauges()
            self._log.info(agent_session.agent, "closed", "agent %s session %s closed: %s", agent_session.agent,
                           agent_session.session_id[:8], session.close_reason)

    def _control_table(self) -> ControlDispatcher[AgentSession]:
        """What the gateway does with an agent's control frames: one table for every session."""
        table: ControlDispatcher[AgentSession] = ControlDispatcher(self._on_unexpected)
        table.on(wire.Register, self._on_register)
        table.on(wire.Routes, self._on_routes)
        table.on(wire.Drain, self._on_drain)
        return table

    def _on_routes(self, agent_session: AgentSession, frame: wire.Routes) -> None:
        if self.layer3 is None:
            self._log.info(agent_session.agent, "l3-off", "agent %s announced layer-3 CIDRs, but layer3 is "
                           "not enabled on this gateway: ignored", agent_session.agent)
            return
        # Rate-limited like registrations: each announcement costs the policy a rebuild.
        if not self.routes_buckets.take(agent_session.agent):
            self.metrics.handshake_failures.labels(Reason.ROUTES_RATE.label).inc()
            self._log.warning(agent_session.agent, Reason.ROUTES_RATE.label, "agent %s announces layer-3 CIDRs too "
                              "often (register_burst, then register_rate): ignored", agent_session.agent)
            return
        self.layer3.on_routes(agent_session, frame)

    def _on_drain(self, agent_session: AgentSession, frame: wire.Drain) -> None:
        # The session is DRAINING already (the core's state): the registry picks other agents for new streams.
        self._log.info(agent_session.agent, "draining", "agent %s session %s is draining: %s",
                       agent_session.agent, agent_session.session_id[:8], frame.reason)

    def _on_unexpected(self, agent_session: AgentSession, frame: wire.ControlFrame) -> None:
        self._log.info(agent_session.agent, "unexpected", "agent %s sent unexpected %s; ignored",
                       agent_session.agent, type(frame).__name__)

    def _stream_closed(self, _: Stream) -> None:
        self.metrics.streams.dec()

    # ------------------------------------------------------------ registrations, rate-limited per identity

    def _on_register(self, s: AgentSession, frame: wire.Register) -> None:
        """Apply a REGISTER now, or, over the identity's rate, hold it until the rate allows.

        Each REGISTER is the agent's complete list, so only the newest held one matters: an honest agent whose
        Node list changes many times in a burst ends with its latest list applied, and a churning one costs one
        registration per 1/register_rate seconds however fast it sends.
        """
        if s.pending_register is not None or not self.register_buckets.take(s.agent):
            replaced = s.pending_register is not None
            s.pending_register = frame
            self.metrics.handshake_failures.labels(Reason.REGISTER_RATE.label).inc()
            wait = self.register_buckets.wait(s.agent)
            self._log.info(s.agent, Reason.REGISTER_RATE.label, "agent %s registers too often (register_burst %d, then "
                           "register_rate %g/s): its newest REGISTER is applied in %.1fs%s", s.agent,
                           self.cfg.register_burst, self.cfg.register_rate, wait,
                           " (it replaced a waiting one)" if replaced else "")
            if s.register_timer is None:
                s.register_timer = asyncio.get_running_loop().call_later(wait, self._apply_pending, s)
            return
        self._apply_register(s, frame)

    def _apply_pending(self, s: AgentSession) -> None:
        s.register_timer = None
        frame = s.pending_register
        if frame is None or s.session.closed:
            s.pending_register = None
            return
        if not self.register_buckets.take(s.agent):  # another session of the identity took the token
            s.register_timer = asyncio.get_running_loop().call_later(
                self.register_buckets.wait(s.agent), self._apply_pending, s)
            return
        s.pending_register = None
        self._apply_register(s, frame)

    @staticmethod
    def _cancel_pending(s: AgentSession) -> None:
        if s.register_timer is not None:
            s.register_timer.cancel()
        s.register_timer = None
        s.pending_register = None

    def _apply_register(self, s: AgentSession, frame: wire.Register) -> None:
        if s.session.closed:
            return
        accepted, refused = self.registry.register(s, frame.nodes)
        self._log.info(s.agent, "registered", "agent %s session %s registered %d nodes (%d refused)", s.agent,
                       s.session_id[:8], len(accepted), len(refused))
        self.answer_register(s, accepted, refused)
        self._update_gauges()

    def answer_register(self, s: AgentSession, accepted: list[str], refused: list[tuple[str, Refusal]]) -> None:
        """Count a registration's refusals and tell the agent the outcome; also for a registration evaluated
        again (Node objects or the configuration's pools changed)."""
        if refused:
            claimed = {n.name: n.pool for n in s.last_register}
            for name, refusal in refused:
                pool = claimed.get(name, "")
                # Label values come only from the certificate and the reason's code: an agent cannot mint series.
                label = pool if pool in s.pools else "other"
                self.metrics.refusals.labels(label, refusal.label).inc()
        for answer in wire.split_registered(accepted, told(refused)):
            s.session.send_control(answer)

    def _update_gauges(self) -> None:
        """After a registration or a session's end: the gauges, and the long-lived state will settle (gcpause)."""
        gcpause.settle_soon()
        counts: dict[str, int] = {}
        for entry in self.registry.nodes.values():
            counts.setdefault(entry.pool, 0)
            if entry.sessions:
                counts[entry.pool] += 1
        for pool, n in counts.items():
            self.metrics.nodes.labels(pool).set(n)

    def start_drain(self) -> None:
        self.draining = True
        for s in list(self.registry.sessions.values()):
            s.session.send_control(wire.Drain("gateway is draining"))
