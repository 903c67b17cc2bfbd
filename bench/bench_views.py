"""Benchmark: what each read of the ops API's views costs the gateway's event loop at fleet size (issue 34).

A real registry of 10,000 nodes in 10 pools (tests/support/fleetviews.py: 30 failing, one pool's agent gone,
2 refused claims), the gateway's views (gateway/views.py) over it. For each view it prints:

- before: the whole render as the gateway did it until issue 34, on the event loop at every read (the same
  rendering code called directly, plus the JSON/HTML encoding), and its size;
- after, a read when the page is kept (nothing changed): the time on the loop (a lookup);
- after, a read that makes the page: the time on the loop (the snapshot) and in the worker thread (render, hash,
  gzip), and the sizes plain and gzipped;
- the node views' rebuild on the loop after a change of every node (what a registration of the whole fleet
  costs on top of the registration itself), and of one node.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway import discovery, status, views
from gateway.statuspage import render_html
from tests.support.fleetviews import fake_gateway, fleet


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


async def main(args: argparse.Namespace) -> None:
    reg, pools, last, _ = fleet(Path(tempfile.mkdtemp(prefix="raven-views-")))
    gw = fake_gateway(reg, pools, last)
    v = views.Views(gw)
    reg._stale.update(reg.nodes)
    rebuild, _ = timed(lambda: (reg._stale.update(reg.nodes), reg.node_views()), args.repeat)
    one, _ = timed(lambda: (reg._stale.add("edge-gpu-0-1"), reg.node_views()), args.repeat)
    print(f"{len(reg.nodes)} nodes; node views rebuilt on the loop after a change of every node: {best(rebuild)}; "
          f"of one node (a copy of the map): {best(one)}")
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

    for label, read in (
        ("/sd?group=node", lambda: v.sd(sd_node)),
        ("/sd?group=pool", lambda: v.sd(sd_pool)),
        ("/status.html (default page)", lambda: v.status_page(default, html=True)),
        ("/status (default JSON)", lambda: v.status_page(default, html=False)),
        ("/nodes", v.nodes),
    ):
        made, on_loop = [], []
        page = None
        for _ in range(args.repeat):
            for cache in (v.sd_pages, v.status_pages, v.nodes_pages):
                cache.clear()
            started = time.perf_counter()
            task = asyncio.ensure_future(read())
            await asyncio.sleep(0)  # the read's part on the loop: up to handing the render to the thread
            on_loop.append(time.perf_counter() - started)
            page = await task
            made.append(time.perf_counter() - started)
        kept = []
        for _ in range(args.repeat * 20):
            started = time.perf_counter()
            await read()
            kept.append(time.perf_counter() - started)
        assert page is not None
        print(f"after, {label}: {len(page.body)} bytes, {len(page.gzipped)} gzipped; a read that makes it: on the loop "
              f"{best(on_loop)}, made (thread) in {best(made)}; a read when kept: {best(kept)}")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
