"""Backfill figures (docs/backfill.md): bytes the agent keeps per node per hour of dcgm-exporter pages, how long a
1,000-node pool at 15 s fits in the default cap, and the gateway's cost to turn kept scrapes into remote-write
requests (decompress, parse, encode, snappy), from which the catch-up time follows.

    .venv/bin/python -m bench.bench_backfill [--nodes 20] [--minutes 30] [--interval 15]
"""

from __future__ import annotations

import argparse
import time

from agent.backlog import DEFAULT_BYTE_CAP, Backlog
from gateway.backfill import Builder
from raven.config.backfill import GatewayBackfill
from raven.demo.dcgm_page import NodeModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--interval", type=float, default=15)
    args = ap.parse_args()
    scrapes = int(args.minutes * 60 / args.interval)
    models = [NodeModel(f"edge-gpu-{i}", interval=args.interval) for i in range(args.nodes)]
    b = Backlog()
    t0 = 1_800_000_000_000
    raw = 0
    start = time.perf_counter()
    for tick in range(scrapes):
        for i, m in enumerate(models):
            page = m.render(tick)
            raw += len(page)
            b.add(f"edge-gpu-{i}", 9400, t0 + int(tick * args.interval * 1000), page)
    keep_s = time.perf_counter() - start
    per_node_hour = b.bytes / args.nodes * 60 / args.minutes
    cap_minutes = DEFAULT_BYTE_CAP / (1000 * per_node_hour / 60)
    print(f"kept {b.scrapes} scrapes of {args.nodes} nodes: {b.bytes} bytes ({raw / b.bytes:.0f}x smaller than the "
          f"{raw} bytes of pages); {per_node_hour / 1000:.0f} kB per node per hour at {args.interval:g} s; the "
          f"default cap ({DEFAULT_BYTE_CAP >> 20} MiB) holds {cap_minutes:.0f} minutes of 1,000 nodes; keeping took "
          f"{keep_s / b.scrapes * 1000:.2f} ms a scrape (render included)")
    entries = b.batch(1 << 40)
    wire = sum(len(getattr(e, "blob", b"")) + 40 for e in entries)
    cfg = GatewayBackfill(jobs={9400: "edge-dcgm"}, max_age=86400)
    builder = Builder(entries, cfg, lambda node: "pool-a", t0 + int(args.minutes * 60_000))
    start = time.perf_counter()
    requests = body = samples = 0
    while (req := builder.next()) is not None:
        requests += 1
        body += len(req.body)
        samples += req.samples
    build_s = time.perf_counter() - start
    rate = b.scrapes / build_s
    print(f"gateway: {b.scrapes} scrapes ({wire} bytes over the tunnel) into {requests} remote-write requests of "
          f"{body} bytes, {samples} samples, in {build_s:.1f} s: {rate:.0f} scrapes a second on one core, "
          f"{build_s / b.scrapes * 1000:.2f} ms a scrape; 30 minutes of 1,000 nodes at 15 s (120,000 scrapes) "
          f"take {120_000 / rate / 60:.1f} minutes to write; over the tunnel {120_000 * wire / b.scrapes / 1e6:.0f} "
          f"MB, {120_000 * wire / b.scrapes / (2 << 20):.0f} s at the agent's default 2 MiB/s")


if __name__ == "__main__":
    main()
