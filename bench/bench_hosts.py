"""Benchmark: the hosts file of a 100,000-node registry, whole and in shards.

Registers --nodes simulated node names (10 pools, an agent each; names like ``edge-gpu-12345``) in a real
gateway :class:`~gateway.registry.Registry`, then prints:

- the memory the registry holds per registered node (tracemalloc, allocations made while registering);
- the time to render the whole hosts file and the shards (median of --repeat renders), and their sizes
  against one ConfigMap's limit, for IPv4 and for IPv4 + IPv6 service addresses;
- how many names of this length one ConfigMap holds (the ceiling) and the shards needed;
- how long the gateway's event loop stalls while the publisher renders the shards (its snapshot of the registry
  on the loop, the render in a worker thread), against a render on the loop: the longest gap between two turns
  of a ticker task, and the ticker's turns during the publish.

    .venv/bin/python bench/bench_hosts.py --nodes 100000 --shards 4

This is a benchmark, not a test: its figures depend on the machine (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
import tracemalloc
from typing import Any

from gateway.registry import AgentSession, Registry
from raven.dns.hosts import CONFIGMAP_MAX_BYTES, render
from raven.dns.names import NameRule
from raven.dns.publisher import HostsPublisher
from raven.dns.shards import ceiling, render_shards
from raven.ops.gcpause import GC_THRESHOLDS, GcPauses
from raven.protocol import wire


class _IdleSession:
    """What the registry asks of a tunnel session, for registering only."""

    closed = False
    usable = True
    in_flight = 0


def timed(fn: Any, repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(args: argparse.Namespace) -> int:
    pools = 10
    per_pool = args.nodes // pools
    names = [f"edge-gpu-{i}" for i in range(pools * per_pool)]
    registry = Registry(max_nodes_per_agent=per_pool, max_nodes_total=len(names))
    session: Any = _IdleSession()
    agents = [AgentSession(f"agent-{p}", "s", frozenset({f"pool-{p}"}), session) for p in range(pools)]
    infos = [[wire.NodeInfo(names[p * per_pool + k], f"10.{p}.{k // 256}.{k % 256}", f"pool-{p}")
              for k in range(per_pool)] for p in range(pools)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    for agent, nodes in zip(agents, infos, strict=True):
        registry.add_session(agent)
        _, refused = registry.register(agent, nodes)
        assert not refused, refused[:3]
    took = time.perf_counter() - start
    del infos  # what the registry keeps, not the registration messages
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"{len(registry.nodes)} nodes registered in {took:.2f}s (under tracemalloc, several times slower); "
          f"the registry holds {held / 2**20:.1f} MiB, "
          f"{held / len(registry.nodes):.0f} B per node")
    known = sorted(e.name for e in registry.known_nodes())
    gc.set_threshold(*GC_THRESHOLDS)  # as a gateway runs: the registry frozen by a settle after registrations
    gc.freeze()
    for label, addresses in (("IPv4", ["10.96.123.45"]), ("IPv4+IPv6", ["10.96.123.45", "fd00:10:96::1234"])):
        t_whole, whole = timed(lambda a=addresses: render(known, a), args.repeat)
        t_shards, shards = timed(lambda a=addresses: render_shards(known, a, args.shards), args.repeat)
        sizes = [len(s.encode()) for s in shards]
        cap = ceiling(addresses, len(max(known, key=len)))
        print(f"{label}: whole file {len(whole.encode()) / 2**20:.2f} MiB in {t_whole * 1000:.0f} ms "
              f"({'fits' if len(whole.encode()) <= CONFIGMAP_MAX_BYTES else 'does NOT fit'} one ConfigMap; "
              f"one holds {cap} names of {len(max(known, key=len))} characters, so at least "
              f"{-(-len(known) // cap)} shards); {args.shards} shards in {t_shards * 1000:.0f} ms, largest "
              f"{max(sizes) / 2**20:.2f} MiB, smallest {min(sizes) / 2**20:.2f} MiB "
              f"({'all fit' if max(sizes) <= CONFIGMAP_MAX_BYTES else 'one does NOT fit'})")
        print(f"{label}: " + asyncio.run(stalls(registry, addresses, args.shards, args.repeat)))
    return 0


async def stalls(registry: Registry, addresses: list[str], shards: int, repeat: int) -> str:
    """The event loop's longest stall and its turns while the publisher renders ``shards`` shards, in a worker
    thread (as the gateway does) and on the loop (as it did); worst of ``repeat`` publishes."""
    rule = NameRule()  # as the gateway publishes: names copied on the loop, the rule applied in the thread
    publisher = HostsPublisher(lambda: [e.name for e in registry.nodes.values()], addresses, 0.0, [], shards=shards,
                               select=rule.publishable)

    async def on_loop() -> bool:
        contents, _ = publisher.render_snapshot(*publisher.snapshot(), shards=shards)
        return bool(contents)

    out = []
    for label, publish in (("render in a worker thread", publisher.publish_once), ("render on the loop", on_loop)):
        worst, turns, took, gc_worst = 0.0, [], [], 0.0
        for _ in range(repeat):
            done = asyncio.Event()
            gaps = [0.0, 0]

            async def ticker(gaps: list[float] = gaps, done: asyncio.Event = done) -> None:
                last = time.perf_counter()
                while not done.is_set():
                    await asyncio.sleep(0)
                    now = time.perf_counter()
                    gaps[0], gaps[1], last = max(gaps[0], now - last), gaps[1] + 1, now

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            pauses = GcPauses()
            gc.callbacks.append(pauses.callback)
            start = time.perf_counter()
            try:
                assert await publish()
            finally:
                gc.callbacks.remove(pauses.callback)
            took.append(time.perf_counter() - start)
            done.set()
            await task
            worst, turns = max(worst, gaps[0]), [*turns, int(gaps[1])]
            gc_worst = max(gc_worst, *pauses.max)
        out.append(f"{label}: publish {statistics.median(took) * 1000:.0f} ms, longest loop stall "
                   f"{worst * 1000:.0f} ms (longest collection {gc_worst * 1000:.0f} ms), {min(turns)}-{max(turns)} "
                   "loop turns during it")
    start = time.perf_counter()
    publisher.snapshot()
    return (f"{shards} shards published, snapshot on the loop {(time.perf_counter() - start) * 1000:.0f} ms; "
            + "; ".join(out))


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100_000, help="simulated node names (default 100000)")
    parser.add_argument("--shards", type=int, default=4, help="shards to render (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="renders timed, median printed (default 5)")
    return main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(cli())
