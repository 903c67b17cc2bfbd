"""A gateway publishes its hosts file in shards, and a DNS server reading every shard resolves every name.

dnsmasq reads each shard file (--addn-hosts once per file), as CoreDNS's server blocks each read one shard
(deploy/coredns/).
"""

from __future__ import annotations

from pathlib import Path

import dns.asyncresolver
import pytest

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimNode
from raven.dns.shards import shard_of
from tests.support.cluster import HOSTS
from tests.support.dnsmasq import Dnsmasq
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

SERVICE = ["127.0.0.9", "fd00::9"]
SHARDS = 3


async def test_gateway_writes_shards_and_every_name_resolves_across_them(tmp_path: Path) -> None:
    names = [f"shard-node-{i}" for i in range(12)] + ["shard-node-x", "shard.node.example.com"]
    nodes = [SimNode(name, HOSTS[0], 9400) for name in names]
    hosts = tmp_path / "out" / "tunnel-nodes"
    cluster = LocalCluster(
        tmp_path, [PoolSpec("pool-s", nodes, agents=1)],
        gateway_settings={"hosts": {"file": str(hosts), "service_addresses": SERVICE, "shards": SHARDS,
                                    "debounce": 0.1},
                          "allowed_name_suffixes": [".example.com"], "log_level": "warning"},
        agent_settings={"log_level": "warning"},
    )
    files = [hosts] + [hosts.with_name(f"tunnel-nodes.{k}") for k in range(1, SHARDS)]
    dnsmasq: Dnsmasq | None = None
    try:
        await cluster.start()

        def published() -> bool:
            try:
                return all(f"# {sum(shard_of(n, SHARDS) == k for n in names)} node(s)" in f.read_text()
                           for k, f in enumerate(files))
            except FileNotFoundError:
                return False

        await eventually(published, 15, what="every shard written")
        for k, path in enumerate(files):  # each name in its own shard only
            listed = {line.split("\t")[1] for line in path.read_text().splitlines() if line and line[0] != "#"}
            assert listed == {n for n in names if shard_of(n, SHARDS) == k}, k
        assert len({shard_of(n, SHARDS) for n in names}) == SHARDS  # the names really span every shard

        dnsmasq = Dnsmasq(files[0], more_hosts=files[1:])
        await dnsmasq.start()
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [dnsmasq.address]
        resolver.port = dnsmasq.port
        for name in names:
            a = await resolver.resolve(name, "A", lifetime=5)
            aaaa = await resolver.resolve(name, "AAAA", lifetime=5)
            assert [r.to_text() for r in a] == ["127.0.0.9"], name
            assert [r.to_text() for r in aaaa] == ["fd00::9"], name
    finally:
        if dnsmasq is not None:
            await dnsmasq.close()
        await cluster.close()
