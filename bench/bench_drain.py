"""What keep-alive clients get from a gateway that drains under them (issue 29, item 8). Loopback, no root.

    .venv/bin/python -m bench.bench_drain [--clients 120] [--rounds 3]

A real gateway and agent (processes), ten simulated nodes, and ``--clients`` keep-alive connections to the
front end, each sending its next scrape as soon as it has the last answer: the worst case for a drain, whose
connections are always between two requests. After ``--warmup`` seconds the gateway gets SIGTERM; each
connection then ends one of these ways, counted per round:

- ``answered``: its request got a whole answer with ``Connection: close`` (what a drain should give);
- ``eof`` / ``reset``: its request got no byte back, the connection closed (a FIN) or reset. A client sends an
  idempotent request again then (Go's does); a request that was already in the gateway when it closed the
  connection counts here too, which the guard now prevents (raven/http/quiet.py). What remains is a request
  that crossed the close on the wire;
- ``timeout``, ``refused`` (an answer other than 200), ``broken`` (an answer cut short).

Then the gateway is started again and the next round runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, pick_node_port

OUTCOMES = ("answered", "eof", "reset", "timeout", "refused", "broken")


async def answer(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    """Read one answer (Content-Length or chunked body); returns its status line and header fields."""
    status, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
    if "content-length" in fields:
        await reader.readexactly(int(fields["content-length"]))
    elif fields.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            await reader.readexactly(size + 2)
        await reader.readexactly(2)
    return status, fields


async def client(front: tuple[str, int], target: str, counts: collections.Counter[str]) -> None:
    """Scrape ``target`` back to back on one connection until the gateway ends it; count how it ended."""
    reader, writer = await asyncio.open_connection(*front)
    request = f"GET http://{target}/metrics HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
    try:
        while True:
            writer.write(request)
            try:
                async with asyncio.timeout(10):
                    status, fields = await answer(reader)
            except ConnectionResetError:
                counts["reset"] += 1
                return
            except asyncio.IncompleteReadError as exc:
                counts["broken" if exc.partial else "eof"] += 1
                return
            except TimeoutError:
                counts["timeout"] += 1
                return
            counts["requests"] += 1
            if not status.startswith("HTTP/1.1 200"):
                counts["refused"] += 1
                return
            if fields.get("connection", "").lower() == "close":
                counts["answered"] += 1
                return
    finally:
        writer.close()


async def run(clients: int, rounds: int, warmup: float) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="raven-bench-drain-"))
    port = pick_node_port(HOSTS)
    nodes = [SimNode(f"drain-{i}", host, port) for i, host in enumerate(HOSTS)]
    exporter = SimExporter(nodes)
    cluster = LocalCluster(workdir, [PoolSpec("pool-d", nodes, agents=1)], allowed_ports=[port],
                           gateway_settings={"drain_linger": 1.0})
    totals: collections.Counter[str] = collections.Counter()
    try:
        await exporter.start()
        await cluster.start()
        for n in range(1, rounds + 1):
            gateway = cluster.gateway
            assert gateway is not None
            counts: collections.Counter[str] = collections.Counter()
            front = ("127.0.0.1", cluster.front_port)
            tasks = [asyncio.create_task(client(front, f"{nodes[i % len(nodes)].name}:{port}", counts))
                     for i in range(clients)]
            await asyncio.sleep(warmup)
            t0 = time.monotonic()
            gateway.process.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            counts["error"] += sum(isinstance(r, BaseException) for r in results)
            code = await asyncio.wait_for(gateway.process.wait(), 60)
            print(f"round {n}: {clients} connections, {counts['requests']} answers before; at SIGTERM: "
                  + ", ".join(f"{k} {counts[k]}" for k in (*OUTCOMES, "error") if counts[k] or k == "answered")
                  + f"; gateway exited {code} after {time.monotonic() - t0:.1f}s", flush=True)
            totals.update(counts)
            await cluster.start_gateway(0)
            await cluster.wait_registered(60)
    finally:
        await cluster.close()
        await exporter.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print("all rounds: " + ", ".join(f"{k} {totals[k]}" for k in (*OUTCOMES, "error")))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_drain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=120, help="keep-alive connections (12 per node: under the "
                        "front end's 16 requests in flight per client and node)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of scraping before each SIGTERM")
    args = parser.parse_args()
    return asyncio.run(run(args.clients, args.rounds, args.warmup))


if __name__ == "__main__":
    sys.exit(main())
