"""The gateway's layer-3 decisions without a device: who is active, what is routed, whose packets pass."""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.layer3 import GatewayLayer3
from gateway.registry import AgentSession
from gateway.statuspage import _layer3_html, render_text
from raven.layer3.config import GatewayLayer3Settings
from raven.ops.metrics import GatewayMetrics
from raven.protocol import wire


@dataclass
class FakeSession:
    """What the layer-3 runtime uses of a session."""

    carries_datagrams: bool = True
    closed: bool = False
    close_reason: str = ""
    control: list[wire.ControlFrame] = field(default_factory=list)
    datagrams: list[bytes] = field(default_factory=list)
    on_datagram: Callable[[memoryview], None] | None = None

    def send_control(self, frame: wire.ControlFrame) -> None:
        self.control.append(frame)

    def send_datagram(self, packet: bytes | memoryview) -> bool:
        self.datagrams.append(bytes(packet))
        return True


def agent(name: str, cidrs: tuple[str, ...] = ("10.20.0.0/16",), pool: str = "site-a") -> AgentSession:
    return AgentSession(name, name + "-session", frozenset({pool}), FakeSession(), cidrs=cidrs)  # type: ignore[arg-type]


def ipv4(src: str, dst: str) -> bytes:
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20, 0, 0, 64, 1, 0, ipaddress.ip_address(src).packed,
                         ipaddress.ip_address(dst).packed)
    return header


def runtime() -> tuple[GatewayLayer3, GatewayMetrics]:
    cfg = GatewayLayer3Settings(enabled=True, addresses=["10.77.0.1/24"], cloud_cidrs=["10.96.0.0/16"],
                       pools={"site-a": {"cidrs": ["10.20.0.0/16", "10.21.0.0/16"]}})
    metrics = GatewayMetrics()
    return GatewayLayer3(cfg, metrics), metrics


def drops(metrics: GatewayMetrics, reason: str) -> float:
    value: Any = metrics.registry.get_sample_value("raven_gateway_layer3_drops_total", {"reason": reason})
    return float(value or 0)


def test_the_first_agent_is_active_and_routes_are_config_and_certificate_and_announcement() -> None:
    l3, _ = runtime()
    a, b = agent("a"), agent("b")
    l3.on_routes(a, wire.Routes(("10.20.0.0/16", "10.21.0.0/16"), pool="site-a"))  # cert allows 10.20/16 only
    l3.on_routes(b, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    assert l3.active["site-a"].agent is a
    assert [str(n) for n in l3.policy.allowed("site-a")] == ["10.20.0.0/16"]
    told_a = a.session.control[-1]  # type: ignore[attr-defined]
    told_b = b.session.control[-1]  # type: ignore[attr-defined]
    assert isinstance(told_a, wire.Routes) and told_a.active
    assert told_a.cidrs == ("10.77.0.1/32", "10.96.0.0/16")  # the gateway node itself and the cloud
    assert isinstance(told_b, wire.Routes) and not told_b.active


def test_the_standby_is_promoted_when_the_active_session_ends_and_a_reannouncement_keeps_the_active() -> None:
    l3, _ = runtime()
    a, b = agent("a"), agent("b")
    l3.on_routes(a, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    l3.on_routes(b, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    l3.on_routes(a, wire.Routes(("10.20.0.0/16",), pool="site-a"))  # announced again: stays active
    assert l3.active["site-a"].agent is a
    a.session.closed = True  # type: ignore[misc]
    l3.detach(a)
    assert l3.active["site-a"].agent is b
    assert b.session.control[-1] == wire.Routes(("10.77.0.1/32", "10.96.0.0/16"), active=True)  # type: ignore[attr-defined]
    l3.detach(b)
    assert "site-a" not in l3.active and l3.policy.allowed("site-a") == []


def test_packets_from_a_pool_are_checked_against_the_sending_agents_own_cidrs() -> None:
    l3, metrics = runtime()
    a, b = agent("a"), agent("b")
    l3.on_routes(a, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    l3.on_routes(b, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    assert a.session.on_datagram is not None and b.session.on_datagram is not None
    a.session.on_datagram(memoryview(ipv4("10.20.1.1", "10.96.0.5")))  # to the cloud: queued for the device
    a.session.on_datagram(memoryview(ipv4("10.99.1.1", "10.96.0.5")))  # a source outside the pool
    b.session.on_datagram(memoryview(ipv4("10.20.1.2", "10.96.0.5")))  # a standby, from its own CIDRs
    assert drops(metrics, "spoofed") == 1
    assert [bytes(p) for p in l3.host._to_device] == [ipv4("10.20.1.1", "10.96.0.5"), ipv4("10.20.1.2", "10.96.0.5")]
    l3.on_routes(b, wire.Routes((), pool="site-a"))  # b withdraws: its packets no longer pass
    b.session.on_datagram(memoryview(ipv4("10.20.1.2", "10.96.0.5")))
    assert drops(metrics, "no-route") == 1


def test_an_agent_is_refused_for_a_pool_outside_its_certificate_or_without_certificate_cidrs() -> None:
    l3, _ = runtime()
    outsider, bare = agent("x", pool="site-b"), agent("y", cidrs=())
    l3.on_routes(outsider, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    l3.on_routes(bare, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    assert "site-a" not in l3.active and not l3.candidates["site-a"]


def test_status_shows_the_active_agent_and_the_routes_of_each_pool() -> None:
    l3, _ = runtime()
    l3.on_routes(agent("a"), wire.Routes(("10.20.0.0/16",), pool="site-a"))
    snap = l3.status()
    assert snap["pools"]["site-a"] == {"active": "a", "routed": ["10.20.0.0/16"], "candidates": ["a"]}
    page = _layer3_html(snap)
    assert "<td>site-a</td><td>a</td><td>10.20.0.0/16</td>" in page
    text = render_text({"replica": "r", "replicas": 1, "uptime_seconds": 1, "ready": True, "ready_reason": "ok",
                        "draining": False, "pools": [], "nodes": [], "layer3": snap})
    assert "site-a       a             10.20.0.0/16  -" in text


def test_announcements_are_bounded_and_an_unchanged_one_costs_nothing() -> None:
    l3, _ = runtime()
    a = agent("a")
    many = tuple(f"10.20.{i}.0/24" for i in range(65))
    l3.on_routes(a, wire.Routes(many, pool="site-a"))
    assert "site-a" not in l3.active  # over 64 CIDRs: refused
    l3.on_routes(a, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    sent = len(a.session.control)  # type: ignore[attr-defined]
    l3.on_routes(a, wire.Routes(("10.20.0.0/16",), pool="site-a"))  # the same again
    assert len(a.session.control) == sent and l3.active["site-a"].agent is a  # type: ignore[attr-defined]


def test_cloud_side_packets_need_a_cloud_source_or_the_gateways_own() -> None:
    l3, metrics = runtime()
    a = agent("a")
    l3.on_routes(a, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    l3._from_device([ipv4("10.96.1.1", "10.20.0.9"), ipv4("10.77.0.1", "10.20.0.9"), ipv4("192.0.2.1", "10.20.0.9")])
    assert a.session.datagrams == [ipv4("10.96.1.1", "10.20.0.9"), ipv4("10.77.0.1", "10.20.0.9")]  # type: ignore[attr-defined]
    assert drops(metrics, "spoofed") == 1


def claims(l3: GatewayLayer3, a: AgentSession, carrying: bool) -> None:
    """Agent ``a`` tells this replica whether it carries its pool (through any replica)."""
    l3.on_routes(a, wire.Routes(("10.20.0.0/16",), active=carrying, pool="site-a"))


def told_active(a: AgentSession) -> bool:
    frames = [f for f in a.session.control if isinstance(f, wire.Routes)]  # type: ignore[attr-defined]
    return bool(frames) and frames[-1].active


def test_two_replicas_that_chose_two_agents_converge_on_one() -> None:
    (r1, _), (r2, _) = runtime(), runtime()
    # Each agent holds a session to each replica (sessions are per replica).
    a1, b1 = agent("agent-a"), agent("agent-b")
    a2, b2 = agent("agent-a"), agent("agent-b")
    claims(r1, a1, False)  # replica 1 hears from agent-a first,
    claims(r1, b1, False)
    claims(r2, b2, False)  # replica 2 from agent-b first: each chooses another agent
    claims(r2, a2, False)
    assert r1.active["site-a"].agent is a1 and r2.active["site-a"].agent is b2
    # Each agent, told active by one replica, says so to both (agent/layer3.py does on every session).
    for r, a, b in ((r1, a1, b1), (r2, a2, b2)):
        claims(r, a, True)
        claims(r, b, True)
    assert r1.active["site-a"].agent is a1 and r2.active["site-a"].agent is a2  # the lower name, on both
    assert told_active(a1) and told_active(a2) and not told_active(b2)
    claims(r1, b1, False)  # agent-b carries nothing any more, and says so: nothing moves
    claims(r2, b2, False)
    assert r1.active["site-a"].agent is a1 and r2.active["site-a"].agent is a2


def test_an_agent_back_after_a_failure_does_not_take_its_pool_back() -> None:
    l3, _ = runtime()
    a, b = agent("agent-a"), agent("agent-b")
    claims(l3, a, False)
    claims(l3, b, False)
    claims(l3, a, True)
    a.session.closed = True  # type: ignore[misc]  # a FakeSession
    l3.detach(a)
    assert l3.active["site-a"].agent is b
    claims(l3, b, True)
    back = agent("agent-a")  # a new session of agent-a, which carries nothing now
    claims(l3, back, False)
    assert l3.active["site-a"].agent is b and not told_active(back)


def test_an_agent_of_the_pool_with_another_range_is_no_candidate_and_cannot_black_hole_it() -> None:
    """Its certificate names site-a but carries site b's range: refused whether it comes first or later."""
    l3, _ = runtime()
    stray = agent("stray", cidrs=("10.30.0.0/16",))
    l3.on_routes(stray, wire.Routes(("10.30.0.0/16",), pool="site-a"))  # first, while the real agents restart
    assert "site-a" not in l3.active and not l3.candidates["site-a"]
    a = agent("a")
    l3.on_routes(a, wire.Routes(("10.20.0.0/16",), pool="site-a"))
    l3.on_routes(stray, wire.Routes(("10.30.0.0/16",), pool="site-a"))
    stray_claims = wire.Routes(("10.30.0.0/16",), pool="site-a", active=True)  # says it carries the pool
    l3.on_routes(stray, stray_claims)
    assert l3.active["site-a"].agent is a
    assert [c.agent.agent for c in l3.candidates["site-a"]] == ["a"]
    assert [str(n) for n in l3.policy.allowed("site-a")] == ["10.20.0.0/16"]
    assert l3.host.wanted == ("10.20.0.0/16",)


def test_an_agent_that_carries_less_of_the_pool_gives_way_to_one_that_carries_more() -> None:
    l3, _ = runtime()
    narrow = agent("narrow", cidrs=("10.20.7.0/24",))
    full = agent("full", cidrs=("10.20.0.0/16", "10.21.0.0/16"))
    l3.on_routes(narrow, wire.Routes(("10.20.7.0/24",), pool="site-a"))  # came first: carries what it can
    assert l3.active["site-a"].agent is narrow and list(l3.host.wanted) == ["10.20.7.0/24"]
    l3.on_routes(full, wire.Routes(("10.20.0.0/16", "10.21.0.0/16"), pool="site-a"))
    assert l3.active["site-a"].agent is full
    assert list(l3.host.wanted) == ["10.20.0.0/16", "10.21.0.0/16"]
    told = narrow.session.control[-1]  # type: ignore[attr-defined]
    assert isinstance(told, wire.Routes) and not told.active
    # Its claim to carry the pool (through another replica) does not bring it back while the fuller one is here.
    l3.on_routes(narrow, wire.Routes(("10.20.7.0/24",), pool="site-a", active=True))
    assert l3.active["site-a"].agent is full
    full.session.closed = True  # type: ignore[misc]
    l3.detach(full)
    assert l3.active["site-a"].agent is narrow  # the best there is now
