"""gateway/pools.py and the pools' configuration: a pool's reach, its direct nodes, the hosts file and /sd."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from gateway import discovery
from gateway.pools import Pools, label_reach
from gateway.registry import AgentSession, NodeEntry, Registry
from gateway.request import Refusal
from raven import config as cfgmod
from raven.config import GatewayConfig
from raven.dns.hosts import render
from raven.errors import ConfigError
from raven.kube import KubeNode
from raven.protocol import wire


def gateway_config(tmp_path: Path, **tree: object) -> GatewayConfig:
    for name in ("cert", "key", "ca"):
        (tmp_path / name).write_text("x")
    tls = {"cert": str(tmp_path / "cert"), "key": str(tmp_path / "key"), "ca": str(tmp_path / "ca")}
    return GatewayConfig.model_validate({"tls": tls, "front": {"listen": "127.0.0.1:1"}, **tree})


def node(name: str, pool: str, labels: dict[str, str], ip: str | None = "10.0.0.5") -> KubeNode:
    return KubeNode(name, pool, (ip,) if ip else (), True, types.MappingProxyType({**labels}), internal=1 if ip else 0)


def test_reach_from_config_then_labels_then_default(tmp_path: Path) -> None:
    cfg = gateway_config(tmp_path, pools={"cloud-1": {"reach": "direct"}, "site-a": {"reach": "tunnel"}},
                         pool_defaults={"reach": "tunnel"})
    pools = Pools(cfg)
    pools.set_kube_nodes({
        "a": node("a", "site-a", {"raven.io/reach": "direct"}),  # config wins over the label
        "b": node("b", "yurt-cloud", {"openyurt.io/is-edge-worker": "false"}),
        "c": node("c", "l3-pool", {"raven.io/reach": "layer3"}),
        "d": node("d", "edge-x", {"openyurt.io/is-edge-worker": "true"}),
    })
    assert (pools.reach("cloud-1"), pools.source("cloud-1")) == ("direct", "config")
    assert (pools.reach("site-a"), pools.source("site-a")) == ("tunnel", "config")
    assert (pools.reach("yurt-cloud"), pools.source("yurt-cloud")) == ("direct", "labels")
    assert pools.reach("l3-pool") == "layer3"
    assert (pools.reach("edge-x"), pools.source("edge-x")) == ("tunnel", "default")
    assert pools.reach("never-heard-of") == "tunnel"


def test_nodes_that_disagree_make_the_pool_a_tunnel_pool(tmp_path: Path) -> None:
    pools = Pools(gateway_config(tmp_path))
    pools.set_kube_nodes({"a": node("a", "p", {"raven.io/reach": "direct"}),
                          "b": node("b", "p", {"raven.io/reach": "layer3"})})
    assert pools.reach("p") == "tunnel"


def test_label_reach() -> None:
    assert label_reach({"raven.io/reach": "Direct"}, "raven.io/reach") == "direct"
    assert label_reach({"raven.io/reach": "bogus", "openyurt.io/is-edge-worker": "false"}, "raven.io/reach") == "direct"
    assert label_reach({"openyurt.io/is-edge-worker": "true"}, "raven.io/reach") is None
    assert label_reach({}, "raven.io/reach") is None


def test_direct_nodes_and_the_proxy_refusal(tmp_path: Path) -> None:
    nodes = [{"name": "c1", "address": "10.1.0.1"}, {"name": "c2"}]
    pools = Pools(gateway_config(tmp_path, pools={"cloud-1": {"reach": "direct", "nodes": nodes}}))
    pools.set_kube_nodes({"k1": node("k1", "yurt-cloud", {"openyurt.io/is-edge-worker": "false"}, "10.2.0.1"),
                          "e1": node("e1", "edge", {})})
    registered = [NodeEntry("r1", "10.3.0.1", "cloud-1"), NodeEntry("e1", "192.168.0.5", "edge")]
    direct = {n.name: n for n in pools.direct_nodes(registered)}
    assert sorted(direct) == ["c1", "c2", "k1", "r1"]
    assert direct["c1"].address == "10.1.0.1" and direct["c2"].address is None
    assert direct["k1"].address == "10.2.0.1" and direct["k1"].pool == "yurt-cloud"
    assert pools.sd_address(direct["c1"]) == "10.1.0.1" and pools.sd_address(direct["c2"]) == "c2"
    with pytest.raises(Refusal) as refused:
        pools.check_proxied("k1", None)
    assert refused.value.status == 421 and "reach: direct" in refused.value.text
    pools.check_proxied("e1", registered[1])  # a tunnel pool's node: no refusal
    pools.check_proxied("unknown", None)
    assert pools.hosts_entries(registered) == {}  # hosts.direct: omit


def test_hosts_direct_internal_ip(tmp_path: Path) -> None:
    cfg = gateway_config(tmp_path, hosts={"direct": "internal-ip"},
                         pools={"cloud-1": {"reach": "direct", "nodes": [{"name": "c1", "address": "10.1.0.1"},
                                                                          {"name": "c2"}]}})
    pools = Pools(cfg)
    entries = pools.hosts_entries([])
    assert entries == {"c1": "10.1.0.1"}
    text = render(["e1"], ["192.0.2.1"], direct=entries)
    assert "10.1.0.1\tc1\n" in text and "192.0.2.1\te1\n" in text and "c2" not in text
    # With the name in DNS, /sd gives the name.
    assert pools.sd_address(pools.direct_nodes([])[0]) == "c1"


def test_sd_groups_and_query(tmp_path: Path) -> None:
    pools = Pools(gateway_config(tmp_path, pools={"cloud-1": {"reach": "layer3",
                                                              "nodes": [{"name": "c1", "address": "fd00::1"}]}}))
    every = discovery.SdQuery((9400,), frozenset(), frozenset())
    for shape in discovery.SHAPES:  # a direct node keeps its own group in either shape: its instance is its own
        groups, _ = discovery.groups([], pools, every._replace(group=shape), 0.0, 60.0)
        assert groups == [{"targets": ["[fd00::1]:9400"], "labels": {
            "node": "c1", "pool": "cloud-1", "port": "9400", "instance": "c1:9400", "__meta_raven_reach": "layer3"}}]
    assert discovery.groups([], pools, every._replace(reaches=frozenset({"tunnel"})), 0.0, 60.0)[0] == []
    query = {"reach": "direct"}
    assert discovery.parse_query(query, lambda k, d: [query[k]] if k in query else d, [9400]) == (
        (9400,), frozenset(), frozenset({"direct"}), "node")
    with pytest.raises(discovery.BadSdQuery, match="group must be one of node, pool"):
        discovery.parse_query({"group": "x"}, lambda k, d: ["x"] if k == "group" else d, [9400])
    with pytest.raises(discovery.BadSdQuery):
        discovery.parse_query({"x": "1"}, lambda k, d: d, [9400])


def test_config_refuses_bad_pools(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="listed under both"):
        gateway_config(tmp_path, pools={"a": {"reach": "direct", "nodes": [{"name": "n"}]},
                                        "b": {"reach": "direct", "nodes": [{"name": "n"}]}})
    with pytest.raises(ValueError, match="a tunnel pool's nodes come from its agents"):
        gateway_config(tmp_path, pools={"a": {"reach": "tunnel", "nodes": [{"name": "n"}]}})
    with pytest.raises(ValueError, match="reach"):
        gateway_config(tmp_path, pools={"a": {"reach": "sideways"}})
    with pytest.raises(ConfigError, match="pools"):
        cfgmod.build(GatewayConfig, None, overrides=["pools.a.reach=sideways"], environ={})


def test_a_direct_pools_node_claimed_by_a_tunnel_agent_stays_direct(tmp_path: Path) -> None:
    """Issue 29 item 1 across the registry, the proxy check and /sd: after an agent of tunnel pool pool-s claims
    pool-d's direct-1, the front end still refuses to proxy it (421) and /sd lists it once (direct)."""
    cfg = gateway_config(tmp_path, pools={"pool-d": {"reach": "direct", "nodes": [{"name": "direct-1",
                                                                                    "address": "10.1.0.1"}]}})
    pools = Pools(cfg)
    reg = Registry()
    reg.placed = pools.placed()
    fake: Any = types.SimpleNamespace(in_flight=0, closed=False, usable=True)
    rogue = AgentSession("s2", "1", frozenset({"pool-s"}), fake)
    reg.add_session(rogue)
    reg.register(rogue, [wire.NodeInfo("direct-1", "10.9.9.9", "pool-s"), wire.NodeInfo("edge-s-1", "10.9.9.8",
                                                                                         "pool-s")])
    with pytest.raises(Refusal) as refused:
        pools.check_proxied("direct-1", reg.lookup("direct-1").entry)
    assert refused.value.status == 421 and "of pool 'pool-d'" in refused.value.text
    _, views = reg.node_views()
    groups, _ = discovery.groups(views.values(), pools, discovery.SdQuery((9400,), frozenset(), frozenset()), 0.0,
                                 60.0)
    assert sorted((g["labels"]["node"], g["labels"]["__meta_raven_reach"]) for g in groups) == [
        ("direct-1", "direct"), ("edge-s-1", "tunnel")]
