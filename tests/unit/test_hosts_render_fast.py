"""The fast render (one join, names checked in batches) writes exactly what a line-by-line render writes, and the
publisher renders in a worker thread on a snapshot while the event loop keeps running."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from raven.dns.hosts import check_names, render
from raven.dns.names import NameRule
from raven.dns.publisher import HostsPublisher
from raven.dns.shards import render_shards, shard_of
from raven.protocol import wire
from tests.support.loopticks import loop_ticks

ADDRESSES = ["fd00:10:96::1234", "10.96.123.45"]  # given IPv6 first: the file lists IPv4 first



def reference(names: Sequence[str], addresses: Sequence[str], direct: Mapping[str, str]) -> str:
    """The hosts file written one line at a time, the plainest way (what the render did before it was made fast)."""
    ips = sorted((ipaddress.ip_address(a) for a in addresses), key=lambda ip: (ip.version, ip))
    unique = sorted(set(names))
    assert all(wire.valid_node_name(n) for n in unique)
    own = {n: ipaddress.ip_address(a) for n, a in direct.items() if n not in unique and wire.valid_node_name(n)}
    lines = [
        "# Edge node names served through the Raven tunnel. Written by raven gateway; do not edit:",
        "# every write replaces the whole file.",
        f"# {len(unique)} node(s) -> {', '.join(str(ip) for ip in ips) or 'no service address configured'}",
    ]
    if own:
        lines.append(f"# {len(own)} node(s) of direct and layer3 pools -> their own addresses")
    for name in sorted({*unique, *own}):
        if name in own:
            lines.append(f"{own[name]}\t{name}")
        else:
            lines.extend(f"{ip}\t{name}" for ip in ips)
    return "\n".join(lines) + "\n"


def mixed(rng: random.Random, n: int) -> tuple[list[str], dict[str, str]]:
    names = [f"edge-gpu-{rng.randrange(10 * n)}" for _ in range(n)]  # with duplicates, in no order
    names += [f"edge-{c}" for c in "abcxyz"] + [f"node-{i}.edge.example.com" for i in range(5)]
    direct = {f"direct-{i}": f"10.1.{i}.{i}" for i in range(0, 30, 3)}
    direct |= {f"edge-v6-{i}": f"FD00:0:0::{i:x}" for i in range(5)}  # written in the canonical form
    direct |= {names[0]: "10.9.9.9", "Not_Valid": "10.9.9.8"}  # a tunnel name stays the tunnel's; a bad one is left out
    direct |= {"a": "10.0.0.1", "zzzz": "fd00::1"}  # before the first and after the last tunnel name
    return names, direct


@pytest.mark.parametrize("addresses", [ADDRESSES, ADDRESSES[:1], ADDRESSES[1:], []])
def test_render_writes_what_the_line_by_line_render_writes(addresses: list[str]) -> None:
    rng = random.Random(23)
    for size in (0, 1, 50, 5_000):
        names, direct = mixed(rng, size)
        assert render(names, addresses, direct=direct) == reference(names, addresses, direct)
        assert render(names, addresses) == reference(names, addresses, {})
        for shards in (2, 4, 10):
            parts = render_shards(names, addresses, shards, direct=direct)
            for k, part in enumerate(parts):
                assert part == reference([n for n in names if shard_of(n, shards) == k], addresses,
                                         {n: a for n, a in direct.items() if shard_of(n, shards) == k})


def test_names_checked_in_batches_agree_with_the_name_rule_one_by_one() -> None:
    rng = random.Random(5)
    alphabet = "ab09-.\nZ_\u00e9 "
    names = ["", "a", "-a", "a-", "a..b", "a.", ".a", "a.b-", "a-b.c", "a\nb", "a" * 63, "a" * 64,
             ".".join(["a" * 63] * 4)[:253], ".".join(["a" * 63] * 4)[:254] + "a", "a" * 63 + ".b-c.d"]
    names += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 9))) for _ in range(20_000)]
    names += [f"edge-gpu-{i}" for i in range(20_000)]
    valid, bad = check_names(names)
    assert valid == sorted({n for n in names if wire.valid_node_name(n)})
    assert bad == sorted({n for n in names if not wire.valid_node_name(n)})
    assert len(valid) > 20_000 and len(bad) > 1_000  # both kinds were really there


def test_the_name_rule_over_many_names_allows_what_it_allows_one_by_one() -> None:
    rng = random.Random(7)
    names = ["10.0.0.1", "2130706433", "0x7f000001", "0x7f.1", "017700000001", "1.2.3", "a.123", "abc", "fade",
             "dead.beef", "0xg", "x1", "edge-1", "edge-1.local", "kubernetes", "coredns", "a.svc", "svc",
             "node.cluster.local", "cluster.local", "a.b.localhost", "localhost"]
    names += ["".join(rng.choice("0123456789abcdefx.-gz") for _ in range(rng.randrange(1, 12))) for _ in range(30_000)]
    valid, _ = check_names(names)
    for rule in (NameRule(), NameRule(["abc"], [], ""), NameRule([], ["dead.beef"], "x1")):
        allowed = rule.publishable(valid)
        assert allowed == [n for n in valid if rule.allows(n)]
        assert 0 < len(allowed) < len(valid)  # the rule really refused some and allowed others


async def test_a_render_of_100000_names_leaves_the_event_loop_running(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"edge-gpu-{i}" for i in range(100_000)] + ["Not_A_Host_Name"]
    pub = HostsPublisher(lambda: names, ADDRESSES, 0.1, [], shards=4)
    rendering = threading.Event()
    render_threads: set[int] = set()
    render_snapshot = pub.render_snapshot

    def watched(*args: Any, **kwargs: Any) -> tuple[list[str], list[str]]:
        render_threads.add(threading.get_ident())
        rendering.set()
        try:
            return render_snapshot(*args, **kwargs)
        finally:
            rendering.clear()

    monkeypatch.setattr(pub, "render_snapshot", watched)
    async with loop_ticks(rendering) as ticks:
        await asyncio.sleep(0)
        before = ticks.turns
        with caplog.at_level(logging.WARNING, "raven.hosts"):
            assert await pub.publish_once()
        during = ticks.turns - before
    assert during > 0  # the loop ran other tasks while publishing
    assert ticks.while_set > 0  # ... while the render itself ran
    assert render_threads and threading.get_ident() not in render_threads  # in a worker thread
    assert pub.content == "".join(render_shards(names[:-1], ADDRESSES, 4))
    skipped = [r for r in caplog.records if "Not_A_Host_Name" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].thread == threading.get_ident()  # logged on the loop's thread
    with caplog.at_level(logging.WARNING, "raven.hosts"):
        assert await pub.publish_once()
    assert len([r for r in caplog.records if "Not_A_Host_Name" in r.getMessage()]) == 1  # once per name
