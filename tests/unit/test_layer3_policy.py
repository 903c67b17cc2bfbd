"""The forwarding policy against a slow reference built from ipaddress, and its rules one by one."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raven.layer3.policy import CLOUD, Drop, ForwardingPolicy, PolicyError, PrefixTable, intersect
from tests.unit.test_layer3_packet import ipv4, ipv6

CLOUD_CIDRS = ["10.96.0.0/12", "10.0.0.0/16", "fd00:c::/48"]
POOLS = {"a": ["10.1.0.0/16", "10.1.128.0/24", "fd00:a::/48"], "b": ["10.2.0.0/16", "fd00:b::/64"],
         "c": ["10.3.0.0/16"]}


def v4(text: str) -> int:
    return int(ipaddress.IPv4Address(text))


def v6(text: str) -> int:
    return int(ipaddress.IPv6Address(text))


@pytest.fixture
def policy() -> ForwardingPolicy:
    return ForwardingPolicy(CLOUD_CIDRS, POOLS, edge_to_edge=[("a", "b")])


def test_the_rules(policy: ForwardingPolicy) -> None:
    assert policy.from_pool("a", ipv4(v4("10.1.0.5"), v4("10.100.0.1"))).target == CLOUD
    assert policy.from_pool("a", ipv4(v4("10.2.0.5"), v4("10.100.0.1"))).drop == Drop.SPOOFED  # b's source
    assert policy.from_pool("a", ipv4(v4("10.1.0.5"), v4("8.8.8.8"))).drop == Drop.NO_ROUTE
    assert policy.from_pool("a", ipv4(v4("10.1.0.5"), v4("10.1.9.9"))).drop == Drop.NO_ROUTE  # its own pool
    assert policy.from_pool("a", ipv4(v4("10.1.0.5"), v4("10.2.0.7"))).target == "b"  # allowed pair
    assert policy.from_pool("b", ipv4(v4("10.2.0.5"), v4("10.1.0.7"))).target == "a"  # both ways
    assert policy.from_pool("a", ipv4(v4("10.1.0.5"), v4("10.3.0.7"))).drop == Drop.EDGE_TO_EDGE_DENIED
    assert policy.from_pool("a", b"\x45garbage").drop == Drop.MALFORMED
    assert policy.from_pool("nobody", ipv4(v4("10.1.0.5"), v4("10.100.0.1"))).drop == Drop.SPOOFED
    assert policy.from_pool("a", ipv6(v6("fd00:a::1"), v6("fd00:c::9"))).target == CLOUD
    assert policy.from_pool("a", ipv6(v6("fd00:b::1"), v6("fd00:c::9"))).drop == Drop.SPOOFED
    assert policy.from_cloud(ipv6(v6("fd00:c::1"), v6("fd00:b::9"))).target == "b"
    assert policy.from_cloud(ipv4(v4("10.100.0.1"), v4("10.3.2.1"))).target == "c"
    assert policy.from_cloud(ipv4(v4("10.100.0.1"), v4("10.100.0.2"))).drop == Drop.NO_ROUTE  # cloud to cloud
    assert policy.from_cloud(b"").drop == Drop.MALFORMED
    # From the cloud side, a source outside cloud_cidrs (anyone routing through the gateway node) is spoofed,
    # unless it is one of the device's own addresses.
    assert policy.from_cloud(ipv4(v4("192.0.2.9"), v4("10.3.2.1"))).drop == Drop.SPOOFED
    local = PrefixTable([(ipaddress.ip_network("192.0.2.9/32"), "")])
    assert policy.from_cloud(ipv4(v4("192.0.2.9"), v4("10.3.2.1")), local).target == "c"


def test_certificate_narrows_a_pools_cidrs() -> None:
    assert [str(n) for n in intersect(["10.1.0.0/16", "10.9.0.0/16"], ["10.1.4.0/24", "10.0.0.0/8"])] == \
        ["10.1.0.0/16", "10.9.0.0/16"]
    assert [str(n) for n in intersect(["10.1.0.0/16", "fd00::/16"], ["10.1.4.0/24"])] == ["10.1.4.0/24"]
    p = ForwardingPolicy(CLOUD_CIDRS, {"a": ["10.1.0.0/16"]}, certificate_cidrs={"a": ["10.1.4.0/24"]})
    assert [str(n) for n in p.allowed("a")] == ["10.1.4.0/24"]
    assert p.from_pool("a", ipv4(v4("10.1.5.1"), v4("10.100.0.1"))).drop == Drop.SPOOFED  # outside the cert
    assert p.from_pool("a", ipv4(v4("10.1.4.1"), v4("10.100.0.1"))).target == CLOUD
    assert p.from_cloud(ipv4(v4("10.100.0.1"), v4("10.1.5.1"))).drop == Drop.NO_ROUTE
    assert ForwardingPolicy(CLOUD_CIDRS, {"a": ["10.1.0.0/16"]}, certificate_cidrs={}).allowed("a") == []


def test_ipv4_and_ipv6_cidrs_both_kept() -> None:
    p = ForwardingPolicy(["10.0.0.0/8", "fd00::/8"], {})
    assert [str(n) for n in p.cloud] == ["10.0.0.0/8", "fd00::/8"]


@pytest.mark.parametrize(("cloud", "pools", "pairs", "message"), [
    (["10.0.0.0/8"], {"a": ["10.1.0.0/16"]}, [], "overlaps"),
    ([], {"a": ["10.1.0.0/16"], "b": ["10.1.2.0/24"]}, [], "overlaps"),
    ([], {"a": ["10.1.0.0/16"], "b": ["10.1.0.0/16"]}, [], "claimed by both"),
    ([], {"a": ["10.1.0.0/16"]}, [("a", "z")], "unknown pool 'z'"),
    ([], {"a": ["10.1.0.0/16"]}, [("a", "a")], "same pool twice"),
    (["10.0.0.1/8"], {}, [], "not a CIDR"),
])
def test_inconsistent_policies_are_refused(cloud: list[str], pools: dict[str, list[str]],
                                           pairs: list[tuple[str, str]], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        ForwardingPolicy(cloud, pools, edge_to_edge=pairs)


def reference(pool: str | None, src: int, dst: int, version: int) -> str | Drop:
    """The rules again, slowly, with ipaddress objects."""
    make = ipaddress.IPv4Address if version == 4 else ipaddress.IPv6Address
    s, d = make(src), make(dst)
    nets = [(ipaddress.ip_network(n), CLOUD) for n in CLOUD_CIDRS]
    nets += [(ipaddress.ip_network(n), p) for p, ns in POOLS.items() for n in ns]
    if pool is not None and not any(s in n for n, o in nets if o == pool):
        return Drop.SPOOFED
    if pool is None and not any(s in n for n, o in nets if o == CLOUD):
        return Drop.SPOOFED  # from the cloud side: the source must be the cloud's
    matches = sorted(((n.prefixlen, o) for n, o in nets if d in n), reverse=True)
    if not matches or matches[0][1] == pool or (pool is None and matches[0][1] == CLOUD):
        return Drop.NO_ROUTE
    owner = matches[0][1]
    if pool is not None and owner != CLOUD and {pool, owner} != {"a", "b"}:
        return Drop.EDGE_TO_EDGE_DENIED
    return owner


V4_NEAR = st.sampled_from(["10.1.0.0", "10.1.128.0", "10.2.0.0", "10.3.0.0", "10.96.0.0", "10.0.0.0", "10.4.0.0"])
V6_NEAR = st.sampled_from(["fd00:a::", "fd00:b::", "fd00:c::", "fd00:d::"])


@given(st.one_of(st.none(), st.sampled_from(["a", "b", "c"])), st.booleans(), V4_NEAR, V4_NEAR, V6_NEAR, V6_NEAR,
       st.integers(0, 2**17), st.integers(0, 2**17))
def test_agrees_with_the_reference(pool: str | None, six: bool, s4: str, d4: str, s6: str, d6: str,
                                   off1: int, off2: int) -> None:
    p = ForwardingPolicy(CLOUD_CIDRS, POOLS, edge_to_edge=[("a", "b")])
    packet_of: Callable[[int, int], bytes]
    if six:
        src, dst, packet_of, version = v6(s6) + off1 * 2**60, v6(d6) + off2 * 2**60, ipv6, 6
    else:
        src, dst, packet_of, version = v4(s4) + off1, v4(d4) + off2, ipv4, 4
    verdict = p.from_pool(pool, packet_of(src, dst)) if pool else p.from_cloud(packet_of(src, dst))
    expected = reference(pool, src, dst, version)
    assert (verdict.drop if verdict.drop is not None else verdict.target) == expected


@given(st.binary(max_size=80), st.sampled_from(["a", "b", "zz"]))
def test_hostile_bytes_never_raise(data: bytes, pool: str) -> None:
    p = ForwardingPolicy(CLOUD_CIDRS, POOLS)
    for verdict in (p.from_pool(pool, data), p.from_cloud(data)):
        assert (verdict.drop is None) != (verdict.target is None)
