"""Benchmark: what each read of the ops API's views costs the gateway's event loop at fleet size (issue 34).

A real registry of 10,000 nodes in 10 pools (tests/support/fleetviews.py: 30 failing, one pool's agent gone,
2 refused claims), the gateway's views (gateway/views.py) over it. For each view it prints:

- before: the whole render as the gateway did it until issue 34, on the event loop at every read (the same
  rendering code called directly, plus the JSON/HTML encoding), and its size;
- after, a read when the page is kept (nothing changed): the time on the loop (a lookup);
- after, a read that makes the page: the time on the loop (the snapshot) and in the worker thread (render, hash,
  gzip), and the sizes plain and gzipped; for the status, with the summary of the node views kept (status.Fleet:
  what every status read after the first since a registration finds) and made again (the first);
- beside it, a task that takes every turn of the event loop it can: the longest wait between two of its turns
  while the page is made, and the sum of its waits over 0.5 ms (the interpreter lock held by the render thread,
  which the loop must take back, and the machine's other work);
- the gateway's /metrics (its registry with 10 pools' series) the same way (made at every read);
- the node views' rebuild after a change of every node (what a registration of the whole fleet costs on top of the
  registration itself: since issue 34's second round made at the registrations, each its own nodes'), and of one;
- the first /sd and status reads after a registration: the loop's longest wait while they are answered, with the
  fleet's summary and the /sd page made by the reads (as before) and made by Views.warm before them (as now).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_views.py --repeat 5

Figures depend on the machine and its load (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway import discovery, status, views
from gateway.statuspage import render_html
from raven.ops.metrics import GatewayMetrics
from raven.ops.pages import Page
from raven.ops.server import MetricsPage
from tests.support.fleetviews import PER_POOL, fake_gateway, fleet


def best(times: list[float]) -> str:
    ms = [t * 1000 for t in times]
    return f"median {statistics.median(ms):.2f} / max {max(ms):.2f} ms"


def timed(fn: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    out: Any = None
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return times, out


async def beside_a_ticker(read: Callable[[], Awaitable[Page]]) -> tuple[list[float], Page]:
    """Make a page while a task takes every turn of the loop it can: the gaps between its turns (the first: the
    read's own part on the loop, up to handing the render to the thread; the others: the loop waiting for the
    interpreter lock while the thread renders, or for a core)."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    started = time.perf_counter()
    task = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    first = time.perf_counter() - started
    tick = asyncio.ensure_future(ticker())
    page = await task
    done = True
    await tick
    return [first, *gaps], page


async def main(args: argparse.Namespace) -> None:
    reg, pools, last, _ = fleet(Path(tempfile.mkdtemp(prefix="raven-views-")))
    gw = fake_gateway(reg, pools, last)
    v = views.Views(gw)
    reg._stale.update(reg.nodes)
    rebuild, _ = timed(lambda: (reg._stale.update(reg.nodes), reg.node_views()), args.repeat)
    one, _ = timed(lambda: (reg._stale.add("edge-gpu-0-1"), reg.node_views()), args.repeat)
    print(f"{len(reg.nodes)} nodes; node views made after a change of every node: {best(rebuild)} (since issue 34's "
          f"second round at the registrations, each its own nodes', not at the first read); of one node: {best(one)}")
    _, node_views = reg.node_views()
    port = 9400
    sd_node = discovery.SdQuery((port,), frozenset(), frozenset())
    sd_pool = sd_node._replace(group="pool")
    default = status.StatusQuery()

    def before_sd() -> bytes:  # the old handler: groups of the whole fleet, json_response's encoding
        groups, _ = discovery.groups(node_views.values(), pools, sd_node, time.monotonic(), reg.rebind_after)
        return json.dumps(groups).encode()

    def before_status() -> bytes:  # the old page listed every node: limit = the fleet
        snap = status.build(v.status_input(), status.StatusQuery(limit=status.MAX_LIMIT * 20))
        return render_html(snap).encode()

    for label, fn in (("/sd (one group per node)", before_sd), ("/status.html (every node)", before_status)):
        times, body = timed(fn, args.repeat)
        print(f"before, {label}: the whole render on the loop at every read: {best(times)}, {len(body)} bytes")

    gw_metrics = GatewayMetrics()  # the gateway's registry with a fleet's children: 10 pools, their codes
    for p in range(10):
        for code in ("200", "502", "504"):
            gw_metrics.requests.labels(f"pool-{p}", "scrape", code).inc()
        gw_metrics.latency.labels(f"pool-{p}").observe(0.01)
        for direction in ("to_edge", "from_edge"):
            gw_metrics.bytes.labels(f"pool-{p}", direction).inc(1000)
        gw_metrics.sessions.labels(f"pool-{p}").set(1)
        gw_metrics.nodes.labels(f"pool-{p}").set(PER_POOL)
    metrics_page = MetricsPage(gw_metrics.registry)

    for label, read in (
        ("/metrics (the gateway's)", metrics_page.page),
        ("/sd?group=node", lambda: v.sd(sd_node)),
        ("/sd?group=pool", lambda: v.sd(sd_pool)),
        ("/status.html (default page)", lambda: v.status_page(default, html=True)),
        ("/status (default JSON)", lambda: v.status_page(default, html=False)),
        ("/nodes", v.nodes),
    ):
        made, on_loop, longest, taken = [], [], [], []
        page = None
        for _ in range(args.repeat):
            for cache in (v.sd_pages, v.status_pages, v.nodes_pages):
                cache.clear()
            gaps, page = await beside_a_ticker(read)
            on_loop.append(gaps[0])
            longest.append(max(gaps))
            taken.append(sum(g for g in gaps if g > 0.0005))
            made.append(sum(gaps))
        if "status" in label:  # the fleet's summary made again too: the first status after a registration
            first = []
            for _ in range(args.repeat):
                v.status_pages.clear()
                v._fleet_kept = None
                started = time.perf_counter()
                await read()
                first.append(time.perf_counter() - started)
            print(f"after, {label}: the first read after a registration (the fleet's summary made again, in the "
                  f"thread): {best(first)}")
        kept = []
        for _ in range(args.repeat * 20):
            started = time.perf_counter()
            await read()
            kept.append(time.perf_counter() - started)
        assert page is not None
        print(f"after, {label}: {len(page.body)} bytes, {len(page.gzipped)} gzipped; a read that makes it: on the loop "
              f"{best(on_loop)}, made (thread) in {best(made)}, the loop's longest wait {best(longest)}, its waits "
              f"over 0.5 ms together {best(taken)}; a read when kept: {best(kept)}")

    # The first reads after the whole fleet registered (issue 34's full-rate run: its worst second), as the gateway
    # made them before (the fleet's summary and /sd rendered by the reads) and as it does now (made by Views.warm
    # a second after the change; the reads find them made).
    a0 = next(s for s in reg.sessions.values() if s.agent == "agent-0")
    listed = list(a0.last_register)
    for label, warm in (("made by the reads", False), ("made by the warmer before the reads", True)):
        longest, taken = [], []
        for k in range(args.repeat):
            await v.sd(sd_pool)  # Prometheus had read it before the change
            reg.register(a0, listed[: len(listed) - 1 + k % 2])  # a node leaves or comes back: a new version
            if warm:
                await v.warm()
            v.status_pages.clear()
            gaps: list[float] = []
            for read in (lambda: v.sd(sd_pool), lambda: v.status_page(default, html=True)):
                more, _ = await beside_a_ticker(read)
                gaps += more
            longest.append(max(gaps))
            taken.append(sum(g for g in gaps if g > 0.0005))
        if warm:
            cpu = []
            for k in range(args.repeat):
                reg.register(a0, listed[: len(listed) - 1 + k % 2])
                started = time.process_time()
                await v.warm()
                cpu.append(time.process_time() - started)
            print(f"Views.warm after a registration (the fleet's summary and /sd?group=pool, what churn costs at most "
                  f"once per {views.WARM_EVERY:g} s): CPU {best(cpu)}")
        print(f"the first /sd?group=pool and /status.html reads after a registration, {label}: the loop's longest "
              f"wait {best(longest)}, its waits over 0.5 ms together {best(taken)}")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
