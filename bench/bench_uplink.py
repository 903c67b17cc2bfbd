"""Scraping through a bad uplink, as Prometheus records it (issue 20, item 3). Needs root (netns testbed).

    sudo flock /tmp/raven-netns.lock .venv/bin/python -m bench.bench_uplink [--nodes 50] [--interval 15]
        [--rtt 150 --loss 1 --rate 5000] [--lossy 120] [--bulk 2] [--outage 30] [--rounds 1]

The real Prometheus scrapes ``--nodes`` simulated dcgm-exporter nodes of one site (tests/support/linkbed.py)
through the tunnel, with the product's default heartbeat, window and reconnect settings, over an uplink shaped
in the namespaces (tests/support/linkdelay.py, iptables, tbf: deploy/testbed/topology.sh shape). Phases:

1. lossy: the link at ``--rtt`` ms round trip, ``--loss`` % lost each way, ``--rate`` kbit/s, for ``--lossy``
   seconds: scrapes, failed scrapes, scrape duration p50/p99/max (successful scrapes), sessions the heartbeat
   dropped (from the gateway's and agents' logs: a drop on a link that is up is a false drop);
2. bulk (with ``--bulk N``): the same link and length, with N incompressible 2 MiB downloads from one node of the
   site running through the tunnel all along (one after another per download loop; issue 29 item 9): the same
   scrape figures, to set beside the first phase's, and how many downloads completed (their throughput);
3. outage (``--rounds`` times, 0 for none): the same link cut (every packet lost, the interface up) for ``--outage``
   seconds, then back: when the gateway saw the site's sessions end, when it held every agent's session again,
   and when every node's next scrape succeeded, all counted from the link's return. The last includes the wait
   for each target's next scrape (up to one interval): that part is Prometheus's phase, not the tunnel's.

Timing figures on a shared, loaded machine are noisy: run it more than once and say so with them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from tests.support.errors import TestbedError
from tests.support.linkbed import Link, LinkBed, lossy_phase, outage_phase


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds == seconds else "n/a"


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds != float("inf") else "not within the bound"


async def run(args: argparse.Namespace) -> int:
    link = Link("bench", args.rtt, args.loss, args.rate)
    bed = LinkBed(count=args.nodes, scrape_interval=args.interval)
    ok = False
    try:
        await bed.start()
        took = await bed.wait_all_up(120)
        print(f"uplink bench: {args.nodes} nodes behind site a, scrape interval {args.interval:g}s; all up after "
              f"{took:.1f}s (clean link)", flush=True)
        lossy = await lossy_phase(bed, link, args.lossy)
        print(f"lossy link ({link.rtt_ms} ms RTT, {link.loss_pct:g}% loss each way, {link.rate_kbit} kbit/s), "
              f"{lossy['seconds']:.0f}s: {lossy['scrapes']:.0f} scrapes, {lossy['failed']:.0f} failed; duration "
              f"p50 {_ms(lossy['p50'])}, p99 {_ms(lossy['p99'])}, max {_ms(lossy['max'])}; heartbeat drops "
              f"{lossy['heartbeat_drops']} {lossy['drops_by_process'] or ''}", flush=True)
        if args.bulk:
            bulk = await lossy_phase(bed, link, args.lossy, downloads=args.bulk)
            rate = bulk["download_bytes"] * 8 / 1000 / bulk["download_seconds"]  # the settling too: they ran
            print(f"same link with {args.bulk} downloads, {bulk['seconds']:.0f}s: {bulk['scrapes']:.0f} scrapes, "
                  f"{bulk['failed']:.0f} failed; duration p50 {_ms(bulk['p50'])}, p99 {_ms(bulk['p99'])}, max "
                  f"{_ms(bulk['max'])} (p99 {bulk['p99'] / lossy['p99']:.1f}x the idle link's); heartbeat drops "
                  f"{bulk['heartbeat_drops']}; downloads completed {bulk['downloads']}, ~{rate:.0f} kbit/s of "
                  f"them, errors {bulk['download_errors'] or 'none'}", flush=True)
        results: list[dict[str, Any]] = []
        for i in range(args.rounds):
            out = await outage_phase(bed, link, args.outage, bound=args.outage + 120)
            results.append(out)
            print(f"outage {i + 1}: link cut {args.outage:g}s; sessions gone {_s(out['sessions_gone_after'])} after "
                  f"the cut; after the return: every agent's session back {_s(out['sessions_back_after'])}, "
                  f"every node scraped OK {_s(out['every_node_up_after'])}", flush=True)
            await asyncio.sleep(2 * args.interval)
        ok = True
    except TestbedError as exc:
        print(f"uplink bench: {exc}", file=sys.stderr)
    finally:
        await bed.close()
        print(f"logs: {bed.workdir}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_uplink", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--interval", type=float, default=15.0, help="Prometheus scrape interval (s)")
    parser.add_argument("--rtt", type=int, default=150, help="round trip (ms)")
    parser.add_argument("--loss", type=float, default=1.0, help="%% of packets lost each way")
    parser.add_argument("--rate", type=int, default=5000, help="kbit/s each way")
    parser.add_argument("--lossy", type=float, default=120.0, help="seconds of scraping through the lossy link")
    parser.add_argument("--bulk", type=int, default=0, help="downloads for a bulk phase after the lossy one")
    parser.add_argument("--outage", type=float, default=30.0, help="seconds the link is cut")
    parser.add_argument("--rounds", type=int, default=1, help="outages")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("uplink bench: the testbed needs root (network namespaces)", file=sys.stderr)
        return 1
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
