"""The agent's layer-3 decisions without a device: what a gateway's offer may install, what passes the device."""

from __future__ import annotations

from agent.layer3 import AgentLayer3
from raven.layer3.config import AgentLayer3 as Layer3Config
from raven.ops.metrics import AgentMetrics


def runtime(**extra: object) -> AgentLayer3:
    cfg = Layer3Config(enabled=True, addresses=["10.20.255.1/32"], cidrs=["10.20.0.0/16"], **extra)
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
