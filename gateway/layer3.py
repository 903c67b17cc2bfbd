"""The gateway's layer 3: IP between its TUN device and the pools' active agents, as datagrams in the sessions.

- Each agent announces its pool's CIDRs (ROUTES). Of every pool's candidates one is **active**: the gateway sends
  the pool's packets to it alone and tells it so (ROUTES with ``active``, carrying the cloud's CIDRs and the pools
  it may reach). When the active session ends, the next candidate of the pool is promoted at once.
- Replicas agree on the active agent: an agent's announcement says whether it carries its pool through any
  replica now (``active`` in the agent's ROUTES). A replica prefers such an agent, the lowest name among several,
  and otherwise keeps its choice: two replicas that chose two agents converge on one as soon as each agent's claim
  arrives, and an agent that comes back after a failure does not take its pool back from the one carrying it. This
  matters where the active agent's node holds the pool's floating LAN address (``layer3.lan_address``).
- What is routed to a pool is its configured CIDRs ∩ the active agent's certificate (``urn:raven:cidr:``) ∩ what it
  announced; routes to those go through the device (installed while the pool has an active agent).
- Only an agent that carries the pool's configured ranges is a candidate: what it would route (that intersection)
  must not be empty, and an agent that carries strictly less of them than another candidate is never chosen (a
  fuller one that arrives takes the pool from it). So no certificate can black-hole a pool: not one naming the
  pool with another range (it is refused), nor a narrower one that connected first while the others restarted.
- A packet from a pool must come from that pool's routed CIDRs (else dropped as ``spoofed``); its destination is
  the cloud (written to the device) or, where the pair is allowed, another pool's active agent.
- Packets read from the device in one loop turn go as one batch; a congested session drops them (``queue-full``):
  IP semantics, never back-pressure on layer 7.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
from typing import Any

from gateway.registry import AgentSession
from raven.layer3 import policy as l3policy
from raven.layer3.config import GatewayLayer3Settings
from raven.layer3.host import Layer3Host
from raven.layer3.policy import CLOUD, Drop, ForwardingPolicy, PrefixTable, intersect
from raven.lograte import RateLimitedLog
from raven.ops.metrics import GatewayMetrics
from raven.protocol import wire

log = logging.getLogger("raven.gateway.layer3")
MAX_ANNOUNCED = 64  # CIDRs one agent may announce for its pool (a ROUTES frame may carry more: the gateway's)


class RouteCandidate:
    """An agent session that announced layer-3 CIDRs for a pool."""

    __slots__ = ("agent", "allowed", "announced", "announced_raw", "claims", "live", "own", "pool", "routed")

    def __init__(self, agent: AgentSession, pool: str, announced: list[str], allowed: list[str], own: ForwardingPolicy,
                 announced_raw: tuple[str, ...] = ()) -> None:
        self.agent = agent
        self.announced_raw = announced_raw  # the ROUTES frame's list as sent (an unchanged one costs nothing)
        self.pool = pool
        self.announced = announced
        self.allowed = allowed  # announced ∩ certificate (the configuration is applied by the policy)
        self.own = own  # the policy as if this agent were the pool's active one: its own sources
        self.routed = own.allowed(pool)  # what the pool's routes would be with it active: config ∩ allowed
        self.live = True  # False once withdrawn, refused or its session ended: its packets are dropped
        self.claims = False  # it says it carries its pool now (through this replica or another)

    @property
    def rank(self) -> tuple[str, str]:
        return self.agent.agent, self.agent.session_id


class GatewayLayer3:
    def __init__(self, cfg: GatewayLayer3Settings, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.host = Layer3Host(cfg.device, cfg.addresses, cfg.mtu, batch=cfg.batch, manage_sysctls=cfg.manage_sysctls,
                               ipv6=any(":" in a for a in cfg.addresses), on_drop=self._drop)
        self.candidates: dict[str, list[RouteCandidate]] = collections.defaultdict(list)  # pool -> in arrival order
        self.active: dict[str, RouteCandidate] = {}
        self.policy: ForwardingPolicy = cfg.policy({})
        # The device's own addresses may also send to the pools (the gateway node itself), besides cloud_cidrs.
        self._local = PrefixTable((ipaddress.ip_network(ipaddress.ip_interface(a).ip), "") for a in cfg.addresses)
        self._from_pools: dict[str, list[int]] = {}  # packets and bytes per pool in this loop turn
        self._count_scheduled = False
        self._log = RateLimitedLog(log)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        cfg = self.cfg
        await self.host.open(self._from_device)
        self._rebuild()  # sessions that announced before the device was up get their routes
        log.info("layer3: device %s up; pools %s; cloud CIDRs %s", cfg.device, ", ".join(sorted(cfg.pools)) or "none",
                 ", ".join(cfg.cloud_cidrs) or "none")

    async def close(self) -> None:
        await self.host.close()
        for pool, cand in list(self.active.items()):
            self.metrics.l3_active.labels(pool, cand.agent.agent).set(0)
        self.active.clear()

    # ------------------------------------------------------------ sessions

    def on_routes(self, agent: AgentSession, frame: wire.Routes) -> None:
        """An agent announced (or withdrew, with no CIDRs) its pool's CIDRs."""
        same = next((c for c in self.candidates.get(frame.pool, ()) if c.agent is agent), None)
        if same is not None and same.live and tuple(same.announced_raw) == frame.cidrs:
            if same.claims != frame.active:  # only its claim changed: see whether this replica should follow it
                same.claims = frame.active
                self._settle(frame.pool)
            return  # otherwise nothing changed: no work, no log
        if len(frame.cidrs) > MAX_ANNOUNCED:
            self._refuse(agent, f"it announces {len(frame.cidrs)} CIDRs (at most {MAX_ANNOUNCED})")
            return
        was_active = any(c.agent is agent for c in self.active.values())
        if not was_active or not frame.cidrs:
            self.detach(agent, quiet=True)
        if not frame.cidrs:
            return
        pool = frame.pool
        if pool not in agent.pools:
            self._refuse(agent, f"pool {pool!r} is not in its certificate (pools {', '.join(sorted(agent.pools))})")
            return
        if pool not in self.cfg.pools:
            self._refuse(agent, f"pool {pool!r} has no layer3.pools entry in the gateway's configuration")
            return
        if not agent.session.carries_datagrams:
            self._refuse(agent, "its session speaks protocol version 1, which carries no layer 3")
            return
        try:
            announced = [str(n) for n in l3policy.collapse(l3policy.network(c) for c in frame.cidrs)]
        except (l3policy.PolicyError, ValueError) as exc:
            self._refuse(agent, f"bad CIDR in its announcement: {exc}")
            return
        allowed = [str(n) for n in intersect(announced, agent.cidrs)]
        if not allowed:
            self._refuse(agent, f"none of {', '.join(announced)} is allowed by its certificate "
                                f"(urn:raven:cidr: {', '.join(agent.cidrs) or 'none'}; reissue with --cidr)")
            return
        current = self.active.get(pool)
        try:
            own = self.cfg.policy({pool: allowed})
        except l3policy.PolicyError as exc:
            self._refuse(agent, f"its CIDRs cannot be routed: {exc}")
            return
        if not own.allowed(pool):
            configured = ", ".join(self.cfg.pools[pool].cidrs) or "none"
            self._refuse(agent, f"it carries none of pool {pool!r}'s configured CIDRs ({configured}): it announces "
                                f"{', '.join(announced)} and its certificate allows {', '.join(agent.cidrs)}; "
                                "it is not a candidate")
            return
        if was_active and current is not None and current.agent is agent:
            # The active agent announced again: it stays active, with what it announces now (unless another
            # candidate now carries more of the pool).
            current.announced, current.allowed, current.own = announced, allowed, own
            current.announced_raw, current.claims = frame.cidrs, frame.active
            current.routed = own.allowed(pool)
            self._log.info(agent.agent, "l3-announce", "layer3: agent %s (pool %s) announced again: %s", agent.agent,
                           pool, ", ".join(announced))
            self._rebuild()
            self._settle(pool)
            return
        if was_active:
            self.detach(agent, quiet=True)  # it moved to another pool: let the old one elect again
        cand = RouteCandidate(agent, pool, announced, allowed, own, frame.cidrs)
        cand.claims = frame.active
        self.candidates[pool].append(cand)
        agent.session.on_datagram = lambda packet, c=cand: self._from_agent(c, packet)
        self._log.info(agent.agent, "l3-announce", "layer3: agent %s (session %s) announced %s for pool %s%s",
                       agent.agent, agent.session_id[:8], ", ".join(announced), pool,
                       " (it carries the pool through another replica)" if frame.active else "")
        if pool not in self.active:
            self._elect(pool)
        else:
            self._tell(cand, active=False)
            self._settle(pool)

    def detach(self, agent: AgentSession, quiet: bool = False) -> None:
        """The session ended (or re-announced): drop it; promote another agent if it was its pool's active one."""
        for pool, cands in list(self.candidates.items()):
            kept = [c for c in cands if c.agent is not agent]
            if len(kept) == len(cands):
                continue
            for c in cands:
                if c.agent is agent:
                    c.live = False
            self.candidates[pool] = kept
            current = self.active.get(pool)
            if current is not None and current.agent is agent:
                del self.active[pool]
                self.metrics.l3_active.labels(pool, agent.agent).set(0)
                if not quiet:
                    log.warning("layer3: active agent %s of pool %s is gone (%s)", agent.agent, pool,
                                agent.session.close_reason or "session ended")
                self._elect(pool)

    def _refuse(self, agent: AgentSession, reason: str) -> None:
        self.detach(agent, quiet=True)  # what it held before this announcement goes too
        self._log.warning(agent.agent, "l3-refused", "layer3: not routing for agent %s: %s", agent.agent, reason)

    def _eligible(self, pool: str) -> list[RouteCandidate]:
        """The pool's candidates that may be active: live, and none carries strictly more of the pool than they."""
        usable = [c for c in self.candidates.get(pool, []) if not c.agent.session.closed]
        return [c for c in usable if not any(l3policy.carries_more(o.routed, c.routed) for o in usable)]

    @staticmethod
    def _preferred(usable: list[RouteCandidate]) -> RouteCandidate | None:
        """The candidate that says it carries the pool (the lowest name among several), if any."""
        claiming = [c for c in usable if c.claims]
        return min(claiming, key=lambda c: c.rank) if claiming else None

    def _settle(self, pool: str) -> None:
        """Follow the agent that carries the pool elsewhere, if it is not this replica's active one."""
        current = self.active.get(pool)
        if current is None:
            return
        eligible = self._eligible(pool)
        preferred = self._preferred(eligible)
        if current not in eligible:
            fuller = next((c for c in eligible if l3policy.carries_more(c.routed, current.routed)), None)
            if fuller is not None:
                log.warning("layer3: agent %s carries more of pool %s (%s) than the active %s (%s): it takes over",
                            fuller.agent.agent, pool, ", ".join(map(str, fuller.routed)), current.agent.agent,
                            ", ".join(map(str, current.routed)))
        elif preferred is None or preferred is current:
            return  # nobody claims, or this replica's choice is the one (the lowest name among claimants)
        else:
            log.info("layer3: agent %s carries pool %s through another replica: following it (instead of %s)",
                     preferred.agent.agent, pool, current.agent.agent)
        del self.active[pool]
        self.metrics.l3_active.labels(pool, current.agent.agent).set(0)
        self._tell(current, active=False)
        self._elect(pool)

    def _elect(self, pool: str) -> None:
        usable = self._eligible(pool)
        if usable:
            chosen = self._preferred(usable) or usable[0]
            self.active[pool] = chosen
            self.metrics.l3_active.labels(pool, chosen.agent.agent).set(1)
            log.info("layer3: agent %s (session %s) now carries pool %s (%s)", chosen.agent.agent,
                     chosen.agent.session_id[:8], pool, ", ".join(chosen.allowed))
            self._tell(chosen, active=True)
        else:
            log.warning("layer3: pool %s has no agent for layer 3: its routes are withdrawn", pool)
        self._rebuild()

    def _reachable(self, pool: str) -> list[str]:
        """What an agent of ``pool`` may reach through this gateway: the cloud, this device's own addresses (the
        gateway node itself), and the pools it may reach."""
        own = [ipaddress.ip_network(ipaddress.ip_interface(a).ip) for a in self.cfg.addresses]
        out = [str(n) for n in l3policy.collapse([*self.policy.cloud, *own])]  # own addresses only where not covered
        for a, b in self.policy.pairs:
            if a == pool:
                out += [str(n) for n in self.policy.allowed(b)]
        return out

    def _tell(self, cand: RouteCandidate, active: bool) -> None:
        cand.agent.session.send_control(wire.Routes(tuple(self._reachable(cand.pool)), active=active))

    def _rebuild(self) -> None:
        try:
            self.policy = self.cfg.policy({p: c.allowed for p, c in self.active.items()})
        except l3policy.PolicyError as exc:
            log.error("layer3: routing policy refused (%s); keeping the previous one", exc)
            return
        self.host.route([str(n) for pool in self.active for n in self.policy.allowed(pool)])
        for cand in self.active.values():  # reachable pools may have changed with the policy
            self._tell(cand, active=True)

    # ------------------------------------------------------------ packets

    def _drop(self, reason: Drop, n: int = 1) -> None:
        self.metrics.l3_drops.labels(reason.value).inc(n)

    def _from_device(self, packets: list[bytes]) -> None:
        """One loop turn's packets from the cloud side: to each destination pool's active agent."""
        policy = self.policy
        counts: dict[str, list[int]] = {}
        for packet in packets:
            verdict = policy.from_cloud(packet, self._local)
            if verdict.drop is not None:
                self._drop(verdict.drop)
                continue
            pool = verdict.target
            assert pool is not None
            cand = self.active.get(pool)
            if cand is None or cand.agent.session.closed:
                self._drop(Drop.NO_ROUTE)
            elif cand.agent.session.send_datagram(packet):
                c = counts.setdefault(pool, [0, 0])
                c[0] += 1
                c[1] += len(packet)
            else:
                self._drop(Drop.QUEUE_FULL if len(packet) <= self.cfg.mtu else Drop.TOO_BIG)
        for pool, (n, size) in counts.items():
            self.metrics.l3_packets.labels(pool, "to_pool").inc(n)
            self.metrics.l3_bytes.labels(pool, "to_pool").inc(size)

    def _from_agent(self, cand: RouteCandidate, packet: memoryview) -> None:
        """A packet from an agent of a pool: its source must lie in what that agent may announce (its own
        certificate; the active agent's CIDRs are the pool's routes), then to the cloud or an allowed pool."""
        pool = cand.pool
        if not cand.live:
            self._drop(Drop.NO_ROUTE)
            return
        if self.active.get(pool) is not cand:
            # A standby (here): its source must be its own (the active one's are the pool's routes); where the
            # packet goes is the pool's policy below.
            own = cand.own.from_pool(pool, packet)
            if own.drop in (Drop.SPOOFED, Drop.MALFORMED):
                self._drop(own.drop)
                return
        verdict = self.policy.from_pool(pool, packet)
        if verdict.drop is not None:
            self._drop(verdict.drop)
            return
        counts = self._from_pools.setdefault(pool, [0, 0])
        counts[0] += 1
        counts[1] += len(packet)
        if not self._count_scheduled and self._loop is not None:
            self._count_scheduled = True
            self._loop.call_soon(self._count)
        if verdict.target == CLOUD:
            self.host.write(packet)
            return
        to = self.active.get(verdict.target or "")
        if to is None or not to.agent.session.send_datagram(packet):
            self._drop(Drop.NO_ROUTE if to is None else Drop.QUEUE_FULL)

    def _count(self) -> None:
        """This loop turn's packets from the pools, counted once (a label lookup per packet would cost more)."""
        self._count_scheduled = False
        for pool, (n, size) in self._from_pools.items():
            self.metrics.l3_packets.labels(pool, "from_pool").inc(n)
            self.metrics.l3_bytes.labels(pool, "from_pool").inc(size)
        self._from_pools.clear()

    # ------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        return {
            "device": self.cfg.device,
            "pools": {
                pool: {
                    "active": self.active[pool].agent.agent if pool in self.active else None,
                    "routed": [str(n) for n in self.policy.allowed(pool)],
                    "candidates": [c.agent.agent for c in self.candidates.get(pool, [])],
                }
                for pool in sorted(self.cfg.pools)
            },
            "device_stats": self.host.device.stats.as_dict() if self.host.device is not None else None,
        }
