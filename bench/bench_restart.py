"""Scrapes lost to restarts, as Prometheus records them (issue 19, item 4). Needs root (netns testbed).

    sudo flock /tmp/raven-netns.lock .venv/bin/python -m bench.bench_restart [--rounds 2]

Two gateway replicas behind the testbed's Service (tests/support/servicelb.py), two agents per pool,
Prometheus scraping the 8 edge targets (4 nodes x dcgm + node-exporter) every second through the Service.
Each round: a rolling restart of both replicas (SIGTERM, exit, start, ready, next), then of the four agents the
same way, then one replica SIGKILLed (not drained) and started again. For each phase it prints how many
scrapes Prometheus recorded and how many failed (``up == 0``), and for the SIGKILL when the failures started
and ended, relative to the kill. Timing figures on a shared machine are noisy: run it more than once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import Any

from tests.support.errors import TestbedError
from tests.support.polling import eventually
from tests.support.testbed import PROMETHEUS, REPLICA_IPS, Testbed

INTERVAL = 1.0
EDGE = '{job=~"edge-.*"}'


async def samples(bed: Testbed, since: float) -> list[tuple[str, float, float]]:
    """Every raw ``up`` sample of the edge targets since ``since`` (wall clock): (target, time, value)."""
    span = f"{max(1, round(time.time() - since + 1))}s"
    data: Any = await bed.get_json(PROMETHEUS + "/api/v1/query", {"query": f"up{EDGE}[{span}]"})
    out = []
    for series in data["data"]["result"]:
        m = series["metric"]
        target = f"{m.get('node', m.get('instance'))}:{m.get('port', '')}"
        out.extend((target, float(t), float(v)) for t, v in series["values"] if float(t) >= since)
    return out


def summary(what: str, rows: list[tuple[str, float, float]], origin: float | None = None) -> str:
    failed = sorted(t for _, t, v in rows if v == 0)
    line = f"{what}: {len(rows)} scrapes, {len(failed)} failed"
    if failed and origin is not None:
        line += (f" (first {failed[0] - origin:+.1f}s, last {failed[-1] - origin:+.1f}s after the kill; "
                 f"{len({n for n, _, v in rows if v == 0})} target(s))")
    return line


async def ready(bed: Testbed) -> bool:
    return await bed.endpoints() == dict.fromkeys(REPLICA_IPS, True)


async def agents_ready(bed: Testbed) -> bool:
    return all([await bed.agent_ready(s, a) for s in bed.sites for a in s.agents])


async def round_(bed: Testbed, n: int) -> None:
    wait = eventually
    t0 = time.time()
    for replica in (1, 2):
        await bed.stop(f"gateway-{replica}", signal.SIGTERM, grace=30)
        await bed.start_gateway(replica)
        await wait(lambda: ready(bed), 60, "replica ready", interval=0.25)
    await asyncio.sleep(2 * INTERVAL)
    print(f"round {n}: " + summary(f"rolling restart of 2 replicas ({time.time() - t0:.0f}s)", await samples(bed, t0)),
          flush=True)
    t0 = time.time()
    for site in bed.sites:
        for agent in site.agents:
            await bed.stop(agent, signal.SIGTERM, grace=30)
            await bed.start_agent(site, agent)
            await wait(lambda s=site, a=agent: bed.agent_ready(s, a), 60, "agent ready", interval=0.25)  # type: ignore[misc]
    await asyncio.sleep(2 * INTERVAL)
    print(f"round {n}: " + summary(f"rolling restart of 4 agents ({time.time() - t0:.0f}s)", await samples(bed, t0)),
          flush=True)
    await asyncio.sleep(3 * INTERVAL)
    killed = time.time()
    await bed.stop("gateway-1", signal.SIGKILL)
    await asyncio.sleep(10 * INTERVAL)
    print(f"round {n}: " + summary("replica SIGKILLed, 10 s after", await samples(bed, killed), killed), flush=True)
    await bed.start_gateway(1)
    await wait(lambda: ready(bed), 60, "replica ready", interval=0.25)
    await wait(lambda: agents_ready(bed), 60, "agents ready", interval=0.25)


async def main_async(rounds: int) -> int:
    bed = Testbed(replicas=2, scrape_interval=INTERVAL)
    try:
        await bed.start()
        await bed.wait_all_up(90)
        await eventually(lambda: ready(bed), 60, "replicas ready", interval=0.25)
        await eventually(lambda: agents_ready(bed), 60, "agents ready", interval=0.25)
        await asyncio.sleep(3 * INTERVAL)
        for n in range(1, rounds + 1):
            await round_(bed, n)
        return 0
    except (TestbedError, AssertionError) as exc:
        print(f"bench_restart: {exc} (logs in {bed.workdir})", file=sys.stderr)
        return 1
    finally:
        await bed.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_restart: needs root (network namespaces)", file=sys.stderr)
        return 1
    return asyncio.run(main_async(args.rounds))


if __name__ == "__main__":
    sys.exit(main())
