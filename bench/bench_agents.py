"""Benchmark: many agents against one gateway: memory per idle session, reconnect storm, failover.

Starts one real gateway process and N lightweight simulated agents (real TLS 1.3 client
certificates, the real session layer, a canned answer to every stream) spread over a few
worker processes; agents are paired into pools of two, each registering --nodes-per-agent
nodes. Then it prints:

- the gateway's RSS per idle session (RSS with N sessions minus RSS before, over N);
- the time until every agent is registered again after the gateway is killed and restarted
  (agents reconnect with exponential backoff and full jitter);
- the failover time after one agent is killed (SIGKILL on its process) while its node is
  scraped continuously, and how many of those scrapes failed.

    .venv/bin/python bench/bench_agents.py --agents 1000

This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import ssl
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from raven import pki
from raven.config import TLSConfig
from raven.demo.launch import LocalCluster, Proc
from raven.protocol import wire
from raven.protocol.errors import RemoteProtocolError
from raven.transport import wsupgrade
from raven.transport.connect import connect
from raven.transport.tls import client_context
from raven.transport.tunnel import Stream


def agent_name(i: int) -> str:
    return f"sim-{i}"


def pool_of(i: int) -> str:
    return f"pool-{i // 2}"


def nodes_of(i: int, per_agent: int) -> tuple[wire.NodeInfo, ...]:
    pool = i // 2  # both agents of a pool register the same nodes
    return tuple(wire.NodeInfo(f"node-{pool}-{k}", "127.0.0.1", pool_of(i)) for k in range(per_agent))


# ---------------------------------------------------------------- one simulated agent (worker side)


async def sim_agent(i: int, url: str, certs: Path, per_agent: int, stop: asyncio.Event) -> None:
    ctx = client_context(TLSConfig(cert=certs / f"{agent_name(i)}.pem", key=certs / f"{agent_name(i)}-key.pem",
                                   ca=certs / "ca.pem"))
    rng = random.Random(i)
    attempt = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        while not stop.is_set():
            try:
                async with asyncio.timeout(30):
                    ws = await http.ws_connect(url, ssl=ctx, server_hostname="raven-gateway", compress=0)
                try:
                    hello = wire.Hello(agent_name(i), uuid.uuid4().hex, window=256 * 1024, max_streams=64)
                    link = wsupgrade.take_over(ws, max_message=wire.DEFAULT_LIMITS.max_frame)
                    session, _ = await connect(link, hello, limits=wire.DEFAULT_LIMITS, timeout=30)
                    attempt = 0

                    def on_open(stream: Stream) -> None:
                        stream.send_head(200, "OK", (("content-type", "text/plain"),))
                        asyncio.get_running_loop().create_task(_answer(stream))

                    session.name = agent_name(i)
                    session.on_open = on_open
                    session.send_control(wire.Register(nodes_of(i, per_agent)))
                    await link.serve(session)
                finally:
                    await ws.close()
            except (aiohttp.ClientError, OSError, TimeoutError, RemoteProtocolError, ssl.SSLError,
                    AttributeError):
                pass
            attempt += 1
            delay = rng.uniform(0, min(10.0, 0.5 * 2 ** min(attempt, 10)))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await stop.wait()


async def _answer(stream: Stream) -> None:
    with contextlib.suppress(Exception):
        await stream.write(b"sim_up 1\n")
        stream.end()


async def worker_main(first: int, count: int, url: str, certs: Path, per_agent: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tasks = []
    for i in range(first, first + count):
        tasks.append(asyncio.create_task(sim_agent(i, url, certs, per_agent, stop)))
        if i % 50 == 49:
            await asyncio.sleep(0.05)  # the first connect is spread a little, like a fleet coming up
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return 0


# ---------------------------------------------------------------- driver


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def gateway_sessions(cluster: LocalCluster) -> float:
    url = f"http://127.0.0.1:{cluster.gateway_metrics_port}/metrics"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http, http.get(url) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return -1
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "raven_gateway_sessions")


async def wait_sessions(cluster: LocalCluster, want: int, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if await gateway_sessions(cluster) >= want:
            return time.monotonic() - start
        await asyncio.sleep(0.2)
    raise RuntimeError(f"only {await gateway_sessions(cluster)} of {want} sessions after {timeout:.0f}s")


async def spawn_worker(first: int, count: int, url: str, certs: Path, per_agent: int, log: Path) -> Proc:
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", str(first), str(count), url, str(certs), str(per_agent),
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
        )
    return Proc(f"worker-{first}", process, log, 0, log)


async def main(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="raven-bench-agents-"))
    n = args.agents
    env = dict(e.split("=", 1) for e in args.gateway_env)
    cluster = LocalCluster(workdir, [], env=env, gateway_settings={
        "log_level": "warning", "limits": {"heartbeat_interval": 3, "heartbeat_timeout": 10},
        "ready_max_wait": 1,
    })
    workers: list[Proc] = []
    finished = False
    print(f"issuing {n} agent certificates ...", flush=True)
    cluster.workdir.mkdir(parents=True, exist_ok=True)
    cluster.make_pki()
    for i in range(n):
        pki.issue(cluster.certs, cluster.certs, "agent", agent_name(i), pools=[pool_of(i)], days=1)
    try:
        gw = await cluster.start_gateway()
        await asyncio.sleep(1)
        base = rss_kib(gw.process.pid)
        url = f"wss://127.0.0.1:{cluster.tunnel_port}/tunnel"
        # Agent 0 runs alone in its own process, so that it can be killed for the failover figure.
        workers.append(await spawn_worker(0, 1, url, cluster.certs, args.nodes_per_agent, workdir / "w0.log"))
        per = (n - 1 + args.workers - 1) // args.workers
        for first in range(1, n, per):
            count = min(per, n - first)
            workers.append(await spawn_worker(first, count, url, cluster.certs, args.nodes_per_agent,
                                              workdir / f"w{first}.log"))
        took = await wait_sessions(cluster, n, 300)
        print(f"{n} agents registered in {took:.1f}s ({n // 2} pools, {n // 2 * args.nodes_per_agent} nodes)")
        await asyncio.sleep(args.idle)
        rss = rss_kib(gw.process.pid)
        print(f"gateway RSS: {base} KiB before, {rss} KiB with {n} idle sessions: "
              f"{(rss - base) / n:.1f} KiB per idle session")

        # Reconnect storm: kill the gateway, start it again, time until every agent is back.
        await cluster.stop(gw, signal.SIGKILL)
        await asyncio.sleep(1)
        start = time.monotonic()
        gw = await cluster.start_gateway()
        took = await wait_sessions(cluster, n, 300)
        print(f"after a gateway kill and restart: all {n} agents registered again in "
              f"{time.monotonic() - start:.1f}s (gateway up in {time.monotonic() - start - took:.1f}s)")

        if args.nodes_per_agent == 0:
            print("failover: skipped (no nodes registered)")
            finished = True
            return 0
        # Failover: scrape a node of pool 0 continuously; kill agent 0's process.
        target = "http://node-0-0:9400/metrics"
        results: list[tuple[float, int]] = []
        stop = asyncio.Event()

        async def scrape_loop() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                while not stop.is_set():
                    t = time.monotonic()
                    try:
                        async with http.get(target, proxy=cluster.front_url) as r:
                            await r.read()
                            results.append((t, r.status))
                    except (aiohttp.ClientError, TimeoutError):
                        results.append((t, 0))
                    await asyncio.sleep(0.01)

        task = asyncio.create_task(scrape_loop())
        await asyncio.sleep(1)
        killed = time.monotonic()
        workers[0].process.send_signal(signal.SIGKILL)
        await wait_sessions_below(cluster, n)
        detected = time.monotonic() - killed
        await asyncio.sleep(1)
        stop.set()
        await task
        after = [s for t, s in results if t >= killed]
        failed = sum(1 for s in after if s != 200)
        print(f"failover after SIGKILL of one agent: gateway dropped its session in {detected * 1000:.0f} ms; "
              f"{len(after)} scrapes of its pool's node after the kill, {failed} failed")
        finished = True
    finally:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                w.process.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                async with asyncio.timeout(10):
                    await w.process.wait()
            except TimeoutError:
                w.process.kill()
        await cluster.close()
        if finished:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs kept in {workdir}", file=sys.stderr)
    return 0


async def wait_sessions_below(cluster: LocalCluster, n: int) -> None:
    while await gateway_sessions(cluster) >= n:  # noqa: ASYNC110 (polls another process)
        await asyncio.sleep(0.005)


def cli() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        first, count, url, certs, per_agent = sys.argv[2:7]
        return run(worker_main(int(first), int(count), url, Path(certs), int(per_agent)))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=1000, help="simulated agents (default 1000)")
    parser.add_argument("--workers", type=int, default=4, help="processes for the agents (default 4)")
    parser.add_argument("--nodes-per-agent", type=int, default=20, help="nodes each pool registers (default 20)")
    parser.add_argument("--idle", type=float, default=5, help="seconds idle before measuring RSS (default 5)")
    parser.add_argument("--gateway-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the gateway process (e.g. RAVEN_NO_UVLOOP=1)")
    return run(main(parser.parse_args()))


def run(coro: object) -> int:
    try:
        import uvloop
    except ImportError:
        return int(asyncio.run(coro))  # type: ignore[arg-type]
    return int(uvloop.run(coro))  # type: ignore[arg-type]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(cli())
