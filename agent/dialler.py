"""The agent's dialler: one link per gateway address, or per replica behind one address, each holding a session.

A link dials (``connect``: the agent's one session, from dial to end), and when its session ends or the dial
fails, dials again: after a refusal or a failure with exponential backoff and full jitter (a fleet's
reconnects spread out when a gateway comes back), after a dial that reached nobody (the uplink is down) soon
and without growing backoff. The dialler re-resolves the gateway's name (agent/targets.py) to follow
scale-up and scale-down: a target that leaves DNS keeps its live session and is not redialled after it; and
it dials one address until it holds sessions to as many replicas as the gateway's WELCOME says exist.

What a gateway or its DNS says is bounded by the agent's own settings: it keeps at most ``gateway.max_replicas``
links, whatever a WELCOME claims or however many addresses the name has (a claim beyond it is logged about once,
and shown as ``raven_agent_gateway_replicas_reported`` beside ``raven_agent_gateway_links``); all links together
dial at most ``dial_burst`` at once and ``dial_rate`` a second after that (a token bucket); and what a dial's
failure logs is rate-limited per gateway address and kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator

import aiohttp

from agent.targets import DialTarget, Resolution, resolve
from raven.config.agent import AgentGateway
from raven.errors import RavenError
from raven.lograte import RateLimitedLog
from raven.ops.metrics import AgentMetrics
from raven.protocol.errors import RemoteProtocolError
from raven.protocol.flow import TokenBucket

__all__ = ["Connect", "Dialler", "DuplicateReplica", "full_jitter", "unreachable"]

log = logging.getLogger("raven.agent")

# Dial, handshake and serve one session through a target (the link's key given); True if the handshake succeeded.
Connect = Callable[[aiohttp.ClientSession, DialTarget, str], Awaitable[bool]]


class DuplicateReplica(RavenError):
    """This connection reached a replica the agent already holds a session to."""


class Stopping(RavenError):
    """The agent stops: a session whose handshake just ended is not started (counted as refused)."""


def full_jitter(attempt: int, initial: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, initial * 2**attempt)]."""
    return rng.uniform(0, min(cap, initial * (2 ** min(attempt, 30))))


class Dialler:
    """Keeps the links to the gateway: which exist, which hold a session now, which retire once it ends."""

    def __init__(self, gateway: AgentGateway, connect: Connect, metrics: AgentMetrics, held: Callable[[], int],
                 rate_log: RateLimitedLog | None = None) -> None:
        self.gateway = gateway
        self._connect = connect
        self.metrics = metrics
        self._held = held  # how many distinct replicas the agent holds a session to
        self._log = rate_log or RateLimitedLog(log)
        self.replicas_expected = 1  # what the latest WELCOME says, held to gateway.max_replicas
        self.replicas_claimed = 1  # what it says
        self._dials = TokenBucket(gateway.dial_rate, gateway.dial_burst, time.monotonic())
        self._links: dict[str, asyncio.Task[None]] = {}
        self._links_changed = asyncio.Event()
        self._live_links: set[str] = set()  # links that hold a session now
        self._retiring: set[str] = set()  # links to end once their session ends
        self._stopping = asyncio.Event()
        self._rng = random.Random()

    @property
    def wanted(self) -> int:
        """How many sessions the agent should hold: one per link, and one per replica the gateway reports."""
        return max(len(self._links), self.replicas_expected)

    def replicas_reported(self, replicas: int) -> None:
        """A WELCOME said how many replicas the gateway has: dial more links (or fewer) behind one address, never
        more than the agent's own ``max_replicas``."""
        self.metrics.replicas_reported.set(replicas)
        if replicas != self.replicas_claimed:
            self._log.info("gateway", "replicas", "gateway reports %d replica(s) (was %d)", replicas,
                           self.replicas_claimed)
            self.replicas_claimed = replicas
        cap = self.gateway.max_replicas
        if replicas > cap:
            self._log.warning("gateway", "replicas-capped", "gateway claims %d replicas, more than this agent's "
                              "gateway.max_replicas (%d): holding at most %d links (raise max_replicas if the "
                              "gateway really has that many)", replicas, cap, cap)
        replicas = min(replicas, cap)
        if replicas != self.replicas_expected:
            self.replicas_expected = replicas
            self._links_changed.set()

    @contextlib.contextmanager
    def live(self, key: str) -> Iterator[None]:
        """While inside, link ``key`` holds a session (a DNS change does not cut it)."""
        self._live_links.add(key)
        try:
            yield
        finally:
            self._live_links.discard(key)

    def stop(self) -> None:
        """Dial no more: every link returns once its session ends, and :meth:`run` returns."""
        self._stopping.set()

    async def _pause(self, delay: float) -> None:
        """Wait ``delay`` seconds, or less when the dialler stops."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._stopping.wait()

    async def _dial_turn(self, key: str) -> None:
        """Wait for this dial's turn: all links together dial at most dial_burst at once, then dial_rate a second."""
        wait = self._dials.reserve(time.monotonic())
        if wait > 0:
            self._log.info("dials", "dial-rate", "dials to the gateway are held to %.1f a second "
                           "(gateway.dial_rate): %s waits %.1fs", self.gateway.dial_rate, key, wait)
            await self._pause(wait)

    async def _link(self, http: aiohttp.ClientSession, target: DialTarget, key: str) -> None:
        """Hold one session through ``target``, redialling with backoff and full jitter."""
        attempt = 0
        gw = self.gateway
        while not self._stopping.is_set():
            await self._dial_turn(key)
            if self._stopping.is_set():
                break
            cut = False
            try:
                if await self._connect(http, target, key):
                    attempt = 0
            except DuplicateReplica as exc:
                self.metrics.connects.labels("duplicate").inc()
                self._log.info(target.key, "duplicate", "%s; dialling again", exc)
            except (RemoteProtocolError, Stopping) as exc:  # the gateway's answer was no, or the agent's
                self.metrics.connects.labels("refused").inc()
                self._log.log(logging.ERROR, target.key, "refused", "%s", exc)
            except (aiohttp.ClientError, OSError, TimeoutError, ssl.SSLError) as exc:
                cut = unreachable(exc)
                if cut:  # every unreachable_retry for as long as the uplink is out: once a minute in the log
                    self.metrics.connects.labels("unreachable").inc()
                    self._log.log(logging.WARNING, target.key, "unreachable", "cannot reach gateway %s: %s",
                                  target.url, _describe(exc))
                else:
                    self.metrics.connects.labels("failed").inc()
                    self._log.warning(target.key, "failed", "cannot reach gateway %s: %s", target.url, _describe(exc))
            if self._stopping.is_set():
                break
            if key in self._retiring:  # its address left DNS while the session lived: do not redial
                self._retiring.discard(key)
                if self._links.get(key) is asyncio.current_task():
                    del self._links[key]
                    self.metrics.links.set(len(self._links))
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
                self._log.info(target.key, "reconnect", "reconnecting to %s in %.2fs (attempt %d)", target.key, delay,
                               attempt)
            await self._pause(delay)

    async def _resolve_unless_stopping(self) -> Resolution | None:
        """Resolve the gateway's name; a drain does not wait for a slow DNS server (None then)."""
        gw = self.gateway
        lookup = asyncio.ensure_future(resolve(gw.url, gw.server_name, gw.resolver))
        stop = asyncio.ensure_future(self._stopping.wait())
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
        """The links to keep: one per address (at most max_replicas: those already kept first), or as many as the
        gateway reports replicas behind one address."""
        if res.per_address:
            cap = self.gateway.max_replicas
            targets = sorted(res.targets, key=lambda t: t.key not in self._links)[:cap]
            if len(res.targets) > cap:
                self._log.warning("gateway", "addresses-capped", "the gateway's name resolves to %d addresses, more "
                                  "than this agent's gateway.max_replicas (%d): dialling %d of them",
                                  len(res.targets), cap, cap)
            return {t.key: t for t in targets}
        target = res.targets[0]
        return {f"{target.key}#{i}": target for i in range(1, max(1, self.replicas_expected) + 1)}

    async def run(self) -> None:
        """Keep one link per gateway address (or per replica behind one address); follow DNS changes."""
        gw = self.gateway
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        res: Resolution | None = None
        # The TCP connect has its own, shorter deadline: one that fails tells a cut uplink from a slow gateway.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(gw.connect_timeout, gw.dial_timeout))
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            try:
                while not self._stopping.is_set():
                    try:
                        res = await self._resolve_unless_stopping() or res
                    except OSError as exc:
                        self._log.warning("gateway", "resolve", "cannot resolve the gateway: %s%s", exc,
                                          " (keeping the current links)" if res else "")
                    if res is not None:
                        self._apply(http, self._desired(res))
                    self._links_changed.clear()
                    # Jittered, so that agents started together do not re-resolve in lockstep; faster while
                    # fewer replicas are held than the gateway says exist (a new replica is found sooner).
                    short = res is None or self._held() < self.replicas_expected
                    base = min(gw.resolve_interval, 5.0) if short else gw.resolve_interval
                    interval = base * self._rng.uniform(0.8, 1.2)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(interval):
                            stop = asyncio.ensure_future(self._stopping.wait())
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
                self.metrics.links.set(0)

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
        self.metrics.links.set(len(self._links))


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
