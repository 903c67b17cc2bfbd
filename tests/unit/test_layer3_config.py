"""The layer3 sections: defaults, the MTU arithmetic, and errors that name the field."""

from __future__ import annotations

import pytest

from raven.errors import ConfigError
from raven.layer3 import config
from raven.layer3.config import AgentLayer3Settings, GatewayLayer3Settings, RoutesLayer3, parse
from raven.protocol import wire


def test_defaults_and_the_mtu_arithmetic() -> None:
    assert config.RAVEN_FRAME_HEADER == wire.HEADER_SIZE  # the frame header the arithmetic counts is the real one
    assert config.TUNNEL_OVERHEAD == 40 + 20 + 12 + 22 + 8 + 6 == 108
    assert config.DEFAULT_MTU == 1392
    g = parse(GatewayLayer3Settings, None)
    assert not g.enabled and g.device == "raven0" and g.mtu == 1392 and g.edge_to_edge == []
    r = parse(RoutesLayer3, {"gateway": "10.0.0.5", "cidrs": ["10.9.0.0/16"]})
    assert (r.table, r.priority, r.interval) == (0x5241, 0x5241, 30.0)


def test_a_full_gateway_section_builds_its_policy() -> None:
    g = parse(GatewayLayer3Settings, {
        "enabled": True, "addresses": ["10.77.0.1/24"], "cloud_cidrs": ["10.96.0.0/12"],
        "pools": {"site-a": {"cidrs": ["10.1.0.0/16"]}, "site-b": {"cidrs": ["10.2.0.0/16"]}},
        "edge_to_edge": [["site-a", "site-b"]],
    })
    policy = g.policy({"site-a": ["10.1.0.0/17"], "site-b": ["10.2.0.0/16"]})
    assert [str(n) for n in policy.allowed("site-a")] == ["10.1.0.0/17"]
    assert ("site-b", "site-a") in policy.pairs


def errors(model: type, data: object) -> str:
    with pytest.raises(ConfigError) as info:
        parse(model, data)
    return str(info.value)


@pytest.mark.parametrize(("model", "data", "line"), [
    (GatewayLayer3Settings, {"pools": {"site-a": {"cidrs": ["10.1.0.1/16"]}}},
     "layer3.pools.site-a.cidrs.0: '10.1.0.1/16' has host bits set (did you mean 10.1.0.0/16?)"),
    (GatewayLayer3Settings, {"enabled": True}, "layer3.addresses: layer 3 is enabled but the device has no address"),
    (GatewayLayer3Settings, {"cloud_cidrs": ["10.0.0.0/8"], "pools": {"a": {"cidrs": ["10.1.0.0/16"]}}},
     "layer3.pools: 10.0.0.0/8 (the cloud) overlaps 10.1.0.0/16 (pool a)"),
    (GatewayLayer3Settings, {"edge_to_edge": [["a", "b"]], "pools": {"a": {"cidrs": ["10.1.0.0/16"]}}},
     "layer3.edge_to_edge: (a, b) names 'b', which is not in pools"),
    (GatewayLayer3Settings, {"pools": {"Bad_Name": {"cidrs": ["10.1.0.0/16"]}}}, "layer3.pools.Bad_Name.[key]"),
    (GatewayLayer3Settings, {"addresses": ["10.77.0.1"]}, "layer3.addresses.0: '10.77.0.1' needs a prefix length"),
    (GatewayLayer3Settings, {"mtu": 1000, "cloud_cidrs": ["fd00::/8"]}, "layer3.mtu: 1000 is below 1280"),
    (GatewayLayer3Settings, {"addresses": ["10.1.0.1/24"], "pools": {"a": {"cidrs": ["10.1.0.0/16"]}}},
     "layer3.addresses: 10.1.0.1/24 lies in pool a's CIDRs"),
    (GatewayLayer3Settings, {"colour": "blue"}, "layer3.colour: unknown setting 'colour' in section 'layer3'"),
    (AgentLayer3Settings, {"device": "much-too-long-name"},
     "layer3.device: 'much-too-long-name' is not a valid device"),
    (AgentLayer3Settings, {"enabled": True, "addresses": ["10.1.0.1/24"]}, "layer3.cidrs: layer 3 is enabled but"),
    (AgentLayer3Settings, {"cidrs": ["10.1.0.0/16", "10.1.0.0/16"]}, "layer3.cidrs: 10.1.0.0/16 is listed twice"),
    (RoutesLayer3, {"gateway": "10.0.0.5", "cidrs": ["10.0.0.0/8"]},
     "layer3.cidrs: 10.0.0.0/8 holds the gateway 10.0.0.5 itself"),
    (RoutesLayer3, {"gateway": "10.0.0.5", "cidrs": ["fd00::/8"]}, "layer3.cidrs: fd00::/8 is IPv6 but gateway"),
    (RoutesLayer3, {"gateway": "10.0.0.5", "cidrs": ["10.9.0.0/16"], "table": 255},
     "layer3.table: table 255 is the kernel's 'local' table"),
    (RoutesLayer3, {"gateway": "10.0.0.5", "cidrs": ["10.9.0.0/16"], "priority": 32766},
     "layer3.priority: Input should be less than or equal to 32765"),
    (RoutesLayer3, {"cidrs": []}, "layer3.gateway: Field required"),
    (AgentLayer3Settings, {"lan_address": "fd00::64/64"}, "layer3.lan_address: fd00::64/64 is IPv6; only IPv4"),
    (AgentLayer3Settings, {"lan_address": "10.1.1.100"}, "layer3.lan_address: '10.1.1.100' needs a prefix length"),
    (AgentLayer3Settings, {"lan_address": "10.1.1.100/32"},
     "layer3.lan_address: 10.1.1.100/32 needs the prefix of the nodes'"),
    (AgentLayer3Settings, {"lan_address": "10.1.1.100/24", "addresses": ["10.1.1.100/32"]},
     "lan_address: 10.1.1.100 is also an address of the TUN device"),
    (AgentLayer3Settings, {"lan_device": "eth0"}, "layer3.lan_device: set without lan_address"),
])
def test_errors_name_the_field(model: type, data: object, line: str) -> None:
    assert line in errors(model, data)
