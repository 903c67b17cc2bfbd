"""A fleet of 10,000 registered nodes for the views' tests and benchmark (tests/unit/test_views.py,
bench/bench_views.py): a real registry, pools, last scrapes; sessions faked (what the views read of them)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gateway import status
from gateway.pools import Pools
from gateway.registry import AgentSession, Registry
from raven.config import GatewayConfig
from raven.protocol import wire
from raven.protocol.state import SessionState


class FakeSession:
    def __init__(self) -> None:
        self.in_flight = 0
        self.usable = True
        self.state = SessionState.OPEN
        self.core = SimpleNamespace(version=wire.PROTOCOL_VERSION)


def gateway_config(tmp_path: Path) -> GatewayConfig:
    for name in ("cert", "key", "ca"):
        (tmp_path / name).write_text("x")
    tls = {"cert": str(tmp_path / "cert"), "key": str(tmp_path / "key"), "ca": str(tmp_path / "ca")}
    return GatewayConfig.model_validate({"tls": tls, "front": {"listen": "127.0.0.1:1"}})


POOLS, PER_POOL = 10, 1000


def agent(name: str, pool: str) -> AgentSession:
    fake: Any = FakeSession()
    return AgentSession(name, f"sid-{name}-0123456789", frozenset({pool}), fake, peer="192.0.2.1", release="0.9.0")


def fleet(tmp_path: Path) -> tuple[Registry, Pools, dict[str, status.NodeResult], AgentSession]:
    """10,000 nodes in 10 pools: 30 failing (pool-3), pool-9's agent gone (1,000 unreachable), 2 refused claims."""
    reg = Registry(rebind_after=3600, max_nodes_per_agent=20_000)
    last: dict[str, status.NodeResult] = {}
    now = time.time()
    gone = None
    for p in range(POOLS):
        a = agent(f"agent-{p}", f"pool-{p}")
        reg.add_session(a)
        names = [f"edge-gpu-{p}-{k}" for k in range(PER_POOL)]
        infos = [wire.NodeInfo(n, "10.0.0.1", f"pool-{p}") for n in names]
        if p == 4:
            infos += [wire.NodeInfo("intruder-1", "10.0.0.1", "pool-0"), wire.NodeInfo("intruder-2", "10.0.0.1",
                                                                                        "pool-y")]
        reg.register(a, infos)
        for k, n in enumerate(names):
            last[n] = status.NodeResult(now - 5, "200", "")
            if p == 3 and k < 30:
                last[n] = status.NodeResult(now - 30 + k, "502", f"cannot connect to node {n}: refused")
        if p == 9:
            gone = a
    assert gone is not None
    reg.remove_session(gone)
    return reg, Pools(gateway_config(tmp_path)), last, gone


def inp_of(reg: Registry, pools: Pools, last: dict[str, status.NodeResult]) -> status.StatusInput:
    _, node_views = reg.node_views()
    sessions = [{"pool": p, "agent": s.agent, "session": s.session_id[:8], "peer": s.peer, "age_seconds": 60.0,
                 "streams": 0, "draining": False, "nodes": len(s.nodes), "version": s.release, "protocol": 3}
                for s in reg.sessions.values() for p in sorted(s.pools)]
    return status.StatusInput("gw-1", 2, time.time() - 3600, (True, "ok"), False, node_views, last, sessions, pools,
                              dict(reg.refused), reg.refused_dropped)


def failing_of(last: dict[str, status.NodeResult]) -> dict[str, status.NodeResult]:
    """What the proxy keeps beside ``last`` (gateway/proxy.py): the nodes whose latest result failed."""
    return {n: r for n, r in last.items() if r.code not in status.OK_CODES}


def fake_gateway(reg: Registry, pools: Pools, last: dict[str, status.NodeResult]) -> Any:
    cfg = SimpleNamespace(replica_id="gw-1", replicas=1, hosts=SimpleNamespace(service_addresses=["10.96.0.10"]))
    backfill = SimpleNamespace(off_reason="", status=lambda: {"pool-3": {"bytes": 4_500_000, "scrapes": 800,
                                                                          "minutes": 12.5}})
    return SimpleNamespace(registry=reg, pools=pools, last=last, failing=failing_of(last), cfg=cfg, started_wall=0.0,
                           ready=lambda: (True, "ok"), draining=False, layer3=None, kube_synced=True, backfill=backfill)
