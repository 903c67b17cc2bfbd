"""The agent's layer 3: its pool's IP packets between its TUN device and the gateway replicas' sessions.

The agent announces its CIDRs (ROUTES) on every session. A gateway answers with what is reachable through it (the
cloud's CIDRs, and other pools where allowed) and whether this agent is the pool's **active** one. While some
gateway says active, the agent routes those CIDRs through its device (so that the pool's nodes reach the cloud
through it); when none does, the routes go, and another agent of the pool carries the traffic.

The agent trusts its gateway no further than it must: a packet from a gateway is written to the device only if its
destination lies in the agent's own CIDRs (the agent is no router into anything else of the edge network), and a
packet read from the device goes up only if its source is the pool's and its destination is one the gateway said
it reaches.
"""

from __future__ import annotations

import logging

from raven.layer3 import policy as l3policy
from raven.layer3.config import AgentLayer3Settings
from raven.layer3.host import Layer3Host
from raven.layer3.lanaddress import FloatingAddress
from raven.layer3.policy import Drop, ForwardingPolicy
from raven.lograte import RateLimitedLog
from raven.ops.metrics import AgentMetrics
from raven.protocol import wire
from raven.transport.tunnel import Tunnel

log = logging.getLogger("raven.agent.layer3")
MIN_PREFIX_V4 = 8  # without layer3.accept_cidrs, a gateway's offer broader than this is not routed
MIN_PREFIX_V6 = 16


class AgentLayer3:
    def __init__(self, cfg: AgentLayer3Settings, pool: str, metrics: AgentMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.host = Layer3Host(cfg.device, cfg.addresses, cfg.mtu, batch=cfg.batch, manage_sysctls=cfg.manage_sysctls,
                               ipv6=any(":" in a for a in (*cfg.addresses, *cfg.cidrs)), on_drop=self._drop,
                               on_write=self._written)
        self.sessions: dict[Tunnel, tuple[tuple[str, ...], bool]] = {}  # session -> (reachable, active)
        self.carrier: Tunnel | None = None  # the session the pool's packets go up (an active one)
        self.policy = ForwardingPolicy((), {pool: cfg.cidrs})
        self.accept = [l3policy.network(c) for c in cfg.accept_cidrs]
        self.lan: FloatingAddress | None = None
        self.carrying = False  # some gateway replica sends this agent its pool's packets (said in its ROUTES)
        if cfg.lan_address is not None:
            self.lan = FloatingAddress(cfg.lan_address, cfg.lan_device, cfg.device,
                                       on_change=lambda held: self.metrics.l3_lan_address.set(1 if held else 0))
        self._log = RateLimitedLog(log)

    async def start(self) -> None:
        await self.host.open(self._from_device)
        if self.lan is not None:
            try:
                await self.lan.start()
            except BaseException:
                await self.host.close()
                raise
        log.info("layer3: device %s up; announcing %s for pool %s", self.cfg.device, ", ".join(self.cfg.cidrs),
                 self.pool)

    async def close(self) -> None:
        try:
            if self.lan is not None:
                await self.lan.close()  # first: the nodes stop sending here before the routes go
        finally:
            await self.host.close()
            self.metrics.l3_active.set(0)

    # ------------------------------------------------------------ sessions

    def attach(self, session: Tunnel) -> None:
        """A new session: take its packets and announce this pool's CIDRs."""
        if not session.carries_datagrams:
            log.warning("layer3: session %s speaks protocol version 1 (no layer 3): not announcing", session.name)
            return
        self.sessions[session] = ((), False)
        session.on_datagram = self._from_gateway
        session.on_closing = lambda: self.detach(session)  # routes follow at once, not after the close
        session.send_control(self._announcement())

    def detach(self, session: Tunnel) -> None:
        if self.sessions.pop(session, None) is not None:
            self._recompute()

    def on_routes(self, session: Tunnel, frame: wire.Routes) -> None:
        if session not in self.sessions:
            return
        reachable, ignored = self._acceptable(frame.cidrs)
        if ignored:
            self._log.warning(session.name, "l3-offer", "layer3: gateway %s offered %d CIDR(s) this agent does not "
                              "route (%s): ignored", session.name, len(ignored), "; ".join(ignored[:5]))
        was = self.sessions[session][1]
        self.sessions[session] = (tuple(reachable), frame.active)
        if frame.active != was:
            log.info("layer3: gateway %s %s this agent to carry pool %s (reaches %s)", session.name,
                     "chose" if frame.active else "no longer chooses", self.pool, ", ".join(reachable) or "nothing")
        self._recompute()

    def _acceptable(self, offered: tuple[str, ...]) -> tuple[list[str], list[str]]:
        """The CIDRs of a gateway's offer this agent will route through its device, and why the rest are not.

        A gateway could otherwise capture the node's own traffic with a broad route: offers are narrowed to
        ``accept_cidrs`` where set, else anything broader than /8 (IPv4) or /16 (IPv6) is refused; a CIDR that
        overlaps the pool's own is refused too."""
        accepted: list[str] = []
        ignored: list[str] = []
        own = self.policy.allowed(self.pool)
        for cidr in offered[: wire.MAX_ROUTES]:
            try:
                net = l3policy.network(cidr)
            except (l3policy.PolicyError, ValueError):
                ignored.append(f"{cidr[:64]!r}: not a CIDR")
                continue
            if any(net.overlaps(o) for o in own):
                ignored.append(f"{net}: overlaps this pool's own CIDRs")
            elif self.accept:
                accepted += [str(n) for n in l3policy.intersect([net], self.accept)]
                if not any(net.overlaps(a) for a in self.accept):
                    ignored.append(f"{net}: outside layer3.accept_cidrs")
            elif net.prefixlen < (MIN_PREFIX_V4 if net.version == 4 else MIN_PREFIX_V6):
                ignored.append(f"{net}: broader than /{MIN_PREFIX_V4 if net.version == 4 else MIN_PREFIX_V6} "
                               "(set layer3.accept_cidrs to allow it)")
            else:
                accepted.append(str(net))
        return accepted, ignored

    def _recompute(self) -> None:
        active = [(s, r) for s, (r, a) in self.sessions.items() if a and not s.closed]
        self.carrier = active[0][0] if active else None
        reachable = tuple(sorted({c for _, r in active for c in r}))
        try:
            self.policy = ForwardingPolicy(reachable, {self.pool: self.cfg.cidrs})
        except l3policy.PolicyError as exc:
            log.error("layer3: cannot use the gateways' routes (%s): keeping the previous ones", exc)
            return
        self.metrics.l3_active.set(1 if active else 0)
        self.host.route(reachable)
        if self.lan is not None:
            self.lan.hold(bool(active))
        if bool(active) != self.carrying:
            # Tell every replica: they converge on the agent that carries the pool (gateway/layer3.py).
            self.carrying = bool(active)
            for session in self.sessions:
                if not session.closed:
                    session.send_control(self._announcement())

    def _announcement(self) -> wire.Routes:
        return wire.Routes(tuple(self.cfg.cidrs), active=self.carrying, pool=self.pool)

    # ------------------------------------------------------------ packets

    def _drop(self, reason: Drop, n: int = 1) -> None:
        self.metrics.l3_drops.labels(reason.value).inc(n)

    def _from_device(self, packets: list[bytes]) -> None:
        """Packets of the pool's nodes for the cloud: up the carrying session, if the policy lets them."""
        carrier = self.carrier
        sent = size = 0
        for packet in packets:
            verdict = self.policy.from_pool(self.pool, packet)
            if verdict.drop is not None:
                self._drop(verdict.drop)
            elif carrier is None:
                self._drop(Drop.NO_ROUTE)
            elif carrier.send_datagram(packet):
                sent += 1
                size += len(packet)
            else:
                self._drop(Drop.QUEUE_FULL if len(packet) <= self.cfg.mtu else Drop.TOO_BIG)
        if sent:
            self.metrics.l3_packets.labels("to_gateway").inc(sent)
            self.metrics.l3_bytes.labels("to_gateway").inc(size)

    def _from_gateway(self, packet: memoryview) -> None:
        verdict = self.policy.from_cloud(packet)
        if verdict.drop is not None:
            self._drop(verdict.drop)  # not for this pool's CIDRs: this agent routes nothing else
            return
        self.host.write(packet)

    def _written(self, packets: list[memoryview]) -> None:
        self.metrics.l3_packets.labels("from_gateway").inc(len(packets))
        self.metrics.l3_bytes.labels("from_gateway").inc(sum(map(len, packets)))
