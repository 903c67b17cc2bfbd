"""Backfill figures (docs/backfill.md): bytes the agent keeps per node per hour of dcgm-exporter pages, how long a
1,000-node pool at 15 s fits in the default cap, and the gateway's cost to turn kept scrapes into remote-write
requests (decompress, parse, encode, snappy), from which the catch-up time follows: in CPU seconds of this process
(time.process_time), the batches as an agent sends them (``--batch-bytes``), three ways: the simple path
gateway/pagewrite.py replaced (tests/support/simplewrite.py: every label parsed, merged, sorted and encoded), the
gateway's (each target's label sets kept from its earlier pages), and the gateway's with nothing kept (every page as
a target's first).

    .venv/bin/python -m bench.bench_backfill [--nodes 20] [--minutes 30] [--interval 15] [--batch-bytes 1048576]
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

from agent.backlog import DEFAULT_BYTE_CAP, Backlog
from gateway import pagewrite
from gateway.catchupbuild import Builder
from raven.config.backfill import GatewayBackfill
from raven.demo.dcgm_page import NodeModel
from raven.protocol import backfill as bf
from tests.support.simplewrite import simple_write


def simple(page: bytes, series: pagewrite.TargetSeries, ts_ms: int) -> tuple[bytes, int]:
    return simple_write(page, series.labels, ts_ms)


def write_back(batches: list[list[bf.Entry]], now_ms: int,
               series: pagewrite.SeriesCache) -> tuple[float, int, int, int]:
    """CPU seconds to turn the batches into requests, and the requests, their bytes, their samples."""
    cfg = GatewayBackfill(jobs={9400: "edge-dcgm"}, max_age=86400)
    requests = body = samples = 0
    start = time.process_time()
    for entries in batches:
        builder = Builder(entries, cfg, lambda node: "pool-a", now_ms, series)
        while (req := builder.next()) is not None:
            requests += 1
            body += len(req.body)
            samples += req.samples
    return time.process_time() - start, requests, body, samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--interval", type=float, default=15)
    ap.add_argument("--batch-bytes", type=int, default=1 << 20, help="the agent's batch_bytes")
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
    batches = []
    while b.scrapes:
        batches.append(b.batch(args.batch_bytes))
        b.ack(max(e.seq for e in batches[-1] if isinstance(e, bf.Scrape)))
    scrapes = sum(isinstance(e, bf.Scrape) for batch in batches for e in batch)
    wire = sum(len(getattr(e, "blob", b"")) + 40 for batch in batches for e in batch)
    now_ms = t0 + int(args.minutes * 60_000)
    with mock.patch("gateway.backfill.pagewrite.encode_page", simple):
        before = write_back(batches, now_ms, pagewrite.SeriesCache())
    after = write_back(batches, now_ms, pagewrite.SeriesCache())
    cold = write_back(batches, now_ms, pagewrite.SeriesCache(max_bytes=0))
    assert before[1:] == after[1:] == cold[1:], "the same requests"
    print(f"gateway: {scrapes} scrapes ({wire} bytes over the tunnel, {len(batches)} batches) into {after[1]} "
          f"remote-write requests of {after[2]} bytes, {after[3]} samples; over the tunnel, 30 minutes of 1,000 "
          f"nodes at 15 s (120,000 scrapes) are {120_000 * wire / scrapes / 1e6:.0f} MB, "
          f"{120_000 * wire / scrapes / (2 << 20):.0f} s at the agent's default 2 MiB/s")
    for what, (cpu, *_) in (("simple path (before)", before), ("kept label sets (the gateway)", after),
                            ("nothing kept (each page a target's first)", cold)):
        rate = scrapes / cpu
        print(f"  {what}: {cpu / scrapes * 1000:.2f} ms of CPU a scrape, {rate:.0f} scrapes a second on one core: "
              f"120,000 scrapes in {120_000 / rate / 60:.1f} minutes")


if __name__ == "__main__":
    main()
