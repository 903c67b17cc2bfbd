"""Benchmark: layer-3 TCP throughput (iperf3) and added RTT (ping) through Raven's tunnel, beside the direct paths
in the same run, in the layer-3 netns testbed (tests/support/l3testbed.py; root).

    sudo PYTHONPATH=. .venv/bin/python bench/bench_layer3.py [--seconds 5] [--pings 50]

Paths measured, all between network namespaces of this machine:

- direct veth: the cloud pod and the cloud gateway's namespace (one veth: the floor of this machine);
- WAN through NAT: site a's gateway node and the cloud gateway's address, through site a's NAT router
  (exactly what the tunnel's own TCP connection rides on);
- layer 3: the cloud pod and site a's gateway node, through the gateway's TUN device, the tunnel (TLS 1.3,
  WebSocket, Raven's DATAGRAM frames), the NAT router and the active agent's TUN device; both directions;
- layer 3 + raven routes: the cloud pod and the node behind site a's gateway node (one more LAN hop).

For the layer-3 runs it also prints the CPU time the gateway and the active agent used per second (both are
single asyncio processes: one core each is the ceiling). This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.l3testbed import (
    CLOUD_NS,
    CLOUD_POD_LINK_IP,
    GATEWAY_WAN_IP,
    POD_IP,
    POD_NS,
    L3Testbed,
)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


async def main(args: argparse.Namespace) -> int:
    bed = L3Testbed(Path(args.workdir) if args.workdir else None)
    rows: list[dict[str, Any]] = []
    try:
        await bed.start()
        await bed.wait_ready(60)
        site = bed.site_a
        assert site.routed_node is not None
        node_ns, node_ip = site.routed_node
        active = await bed.active_agent(site.pool)
        assert active is not None
        pids = {}
        for name in ("gateway", active):
            proc = bed.processes[name].proc
            assert proc is not None
            pids[name] = proc.pid
        await asyncio.sleep(1.0)
        paths = [
            ("direct veth (cloud pod <-> cloud ns)", POD_NS, CLOUD_NS, CLOUD_POD_LINK_IP, False),
            ("WAN through NAT (site a gw node <-> cloud)", site.gw_ns, CLOUD_NS, GATEWAY_WAN_IP, False),
            ("layer 3: cloud pod -> site a gw node", POD_NS, site.gw_ns, site.gw_ip, True),
            ("layer 3: site a gw node -> cloud pod", site.gw_ns, POD_NS, POD_IP, True),
            ("layer 3 + raven routes: cloud pod -> node", POD_NS, node_ns, node_ip, True),
            ("layer 3 + raven routes: node -> cloud pod", node_ns, POD_NS, POD_IP, True),
        ]
        for what, client_ns, server_ns, server_ip, tunnel in paths:
            ping = await bed.ping(client_ns, server_ip, count=args.pings, interval=args.ping_interval)
            cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
            t0 = time.monotonic()
            perf = await bed.iperf3(server_ns, server_ip, client_ns, seconds=args.seconds)
            elapsed = time.monotonic() - t0
            cpu = {n: (cpu_seconds(p) - cpu0[n]) / elapsed for n, p in pids.items()}
            rows.append({"path": what, "tunnel": tunnel, "mbit_s": perf["bits_per_second"] / 1e6,
                         "retransmits": perf["retransmits"], "rtt_avg_ms": ping["avg"], "rtt_min_ms": ping["min"],
                         "rtt_max_ms": ping["max"], "replies": f"{ping['received']:.0f}/{ping['transmitted']:.0f}",
                         "cpu": cpu if tunnel else None})
        metrics = await bed.gateway_metrics()
        drops = {dict(k).get("reason", ""): v for k, v in metrics.get("raven_gateway_layer3_drops_total", {}).items()}
    finally:
        await bed.close()
    direct = rows[0]["rtt_avg_ms"]
    if args.json:
        print(json.dumps({"rows": rows, "drops": drops}, indent=2))
        return 0
    print(f"layer 3 benchmark: iperf3 {args.seconds:g}s per path (1 TCP flow), ping x{args.pings} every "
          f"{args.ping_interval:g}s at idle; {os.cpu_count()} CPUs; MTU of the TUN devices 1392")
    print(f"{'path':44} {'Mbit/s':>8} {'retr':>6} {'RTT avg':>9} {'min':>7} {'max':>7} {'added':>7}  CPU (gw/agent)")
    for r in rows:
        added = f"{r['rtt_avg_ms'] - direct:+.3f}" if r["tunnel"] else ""
        load = ""
        if r["cpu"]:
            gw, ag = r["cpu"]["gateway"], next(v for k, v in r["cpu"].items() if k != "gateway")
            load = f"{gw * 100:.0f}% / {ag * 100:.0f}%"
        print(f"{r['path']:44} {r['mbit_s']:8.0f} {r['retransmits']:6.0f} {r['rtt_avg_ms']:8.3f}m "
              f"{r['rtt_min_ms']:7.3f} {r['rtt_max_ms']:7.3f} {added:>7}  {load}")
    print(f"gateway drops during the run: { {k: v for k, v in drops.items() if v} or 'none'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="iperf3 duration per path")
    parser.add_argument("--pings", type=int, default=50, help="pings per path")
    parser.add_argument("--ping-interval", type=float, default=0.05, help="seconds between pings")
    parser.add_argument("--workdir", help="folder for certificates, configs and logs (default: a temp folder)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    if os.geteuid() != 0:
        print("bench_layer3: needs root (network namespaces, TUN devices)", file=sys.stderr)
        sys.exit(1)
    sys.exit(asyncio.run(main(parser.parse_args())))
