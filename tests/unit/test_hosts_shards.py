"""The hosts file split past one ConfigMap: 100,000 simulated names, every one in exactly one shard that fits."""

from __future__ import annotations

import re

from raven.dns.hosts import CONFIGMAP_MAX_BYTES, render
from raven.dns.shards import ceiling, corefile_blocks, render_shards, shard_of, split, view_regex

ADDRESSES = ["10.96.123.45", "fd00:10:96::1234"]  # a dual-stack Service's ClusterIPs


def fleet(n: int) -> list[str]:
    names = [f"edge-gpu-{i}" for i in range(n - 200)]
    names += [f"edge-{c}" for c in "abcdefghijklmnopqrstuvwxyz"]  # names that end in letters
    names += [f"node-{i}.edge.example.com" for i in range(174)]  # dotted names stay in shard 0
    return names


def names_in(content: str) -> list[str]:
    return [line.split("\t")[1] for line in content.splitlines() if line and not line.startswith("#")]


def test_one_configmap_holds_a_few_tens_of_thousands_and_100000_names_do_not_fit() -> None:
    assert 30_000 < ceiling(ADDRESSES[:1], 15) < 40_000  # one IPv4 address, 15-character names
    assert 15_000 < ceiling(ADDRESSES, 15) < 20_000  # IPv4 and IPv6
    whole = render(fleet(100_000), ADDRESSES)
    assert len(whole.encode()) > CONFIGMAP_MAX_BYTES


def test_every_name_lands_in_exactly_one_shard_and_each_shard_fits() -> None:
    names = fleet(100_000)
    shards = 10
    contents = render_shards(names, ADDRESSES, shards)
    assert len(contents) == shards
    seen: dict[str, int] = {}
    for k, content in enumerate(contents):
        assert len(content.encode()) <= CONFIGMAP_MAX_BYTES, (k, len(content.encode()))
        lines = names_in(content)
        assert len(lines) == 2 * len(set(lines))  # one line per name and address
        for name in set(lines):
            assert name not in seen, f"{name} in shards {seen[name]} and {k}"
            seen[name] = k
            assert shard_of(name, shards) == k
    assert set(seen) == set(names)
    assert all(seen[n] == 0 for n in names if "." in n)


def test_coredns_views_take_exactly_their_shards_names() -> None:
    names = [n + "." for n in fleet(5_000)]  # as CoreDNS sees them: fully qualified
    for shards in (2, 4, 10):
        parts = split(fleet(5_000), shards)
        for k in range(1, shards):
            pattern = re.compile(view_regex(k, shards))
            assert {n for n in names if pattern.match(n)} == {n + "." for n in parts[k]}
            # Never a cluster-internal or reverse query: those stay with the main server block.
            for other in ("edge-gpu-1.monitoring.svc.cluster.local.", "4.3.2.1.in-addr.arpa.", "web-1.default.svc."):
                assert not pattern.match(other)
        blocks = corefile_blocks(shards)
        assert blocks.count("view raven-shard-") == shards - 1
        assert f"/etc/edge-shard-{shards - 1}/tunnel-nodes" in blocks
    assert corefile_blocks(1) == ""
