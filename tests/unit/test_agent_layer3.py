"""The agent's layer-3 decisions without a device: what a gateway's offer may install, what passes the device."""

from __future__ import annotations

from agent.layer3 import AgentLayer3
from raven.layer3.config import AgentLayer3Settings
from raven.ops.metrics import AgentMetrics
from raven.protocol import wire


def runtime(**extra: object) -> AgentLayer3:
    cfg = AgentLayer3Settings(enabled=True, addresses=["10.20.255.1/32"], cidrs=["10.20.0.0/16"], **extra)
    return AgentLayer3(cfg, "site-a", AgentMetrics())


def test_a_gateway_cannot_capture_the_nodes_traffic_with_broad_routes() -> None:
    l3 = runtime()
    accepted, ignored = l3._acceptable(("10.96.0.0/16", "0.0.0.0/1", "128.0.0.0/1", "10.20.5.0/24", "x", "::/0"))
    assert accepted == ["10.96.0.0/16"]
    assert len(ignored) == 5 and any("overlaps this pool's own" in i for i in ignored)


def test_accept_cidrs_narrows_the_offer() -> None:
    l3 = runtime(accept_cidrs=["10.96.0.0/12"])
    accepted, ignored = l3._acceptable(("10.96.0.0/16", "10.64.0.0/10", "172.16.0.0/12", "10.0.0.0/8"))
    assert accepted == ["10.96.0.0/16", "10.96.0.0/12"]  # the /10 narrowed to what the agent accepts
    assert ignored == ["172.16.0.0/12: outside layer3.accept_cidrs", "10.0.0.0/8: overlaps this pool's own CIDRs"]


class FakeSession:
    """What the agent's layer 3 uses of a session to one gateway replica."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.carries_datagrams = True
        self.closed = False
        self.control: list[wire.ControlFrame] = []
        self.on_datagram: object = None
        self.on_closing: object = None

    def send_control(self, frame: wire.ControlFrame) -> None:
        self.control.append(frame)

    def announced(self) -> list[bool]:
        return [f.active for f in self.control if isinstance(f, wire.Routes)]


def test_the_agent_tells_every_replica_whether_it_carries_its_pool() -> None:
    l3 = runtime()
    r1, r2 = FakeSession("replica-1"), FakeSession("replica-2")
    for s in (r1, r2):
        l3.attach(s)  # type: ignore[arg-type]
    assert r1.announced() == [False] and r2.announced() == [False]
    l3.on_routes(r1, wire.Routes(("10.96.0.0/16",), active=True))  # type: ignore[arg-type]
    assert r1.announced() == [False, True] and r2.announced() == [False, True]  # both hear it
    l3.on_routes(r2, wire.Routes(("10.96.0.0/16",), active=False))  # type: ignore[arg-type]
    assert r2.announced() == [False, True]  # still carrying through replica 1: nothing new to say
    l3.detach(r1)  # type: ignore[arg-type]
    assert r2.announced() == [False, True, False]
