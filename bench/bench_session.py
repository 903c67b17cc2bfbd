"""Benchmark: CPU per scrape through the tunnel session alone, in one process, no sockets.

Two asyncio sessions (raven/transport/tunnel.py around their sans-I/O cores) joined back to back in memory
(tests/support/memsession.py); the agent side answers every OPEN with a --size byte body. C workers scrape one
after another for --requests in all; prints the CPU time (process time) per scrape at each concurrency. It
isolates the core <-> asyncio seam from TLS, WebSockets, HTTP parsing and the network: compare two trees with
it, alternating runs (bench/bench_scrape.py measures the whole path).

    PYTHONPATH=. .venv/bin/python bench/bench_session.py --concurrency 32 1 --requests 4000

This is a benchmark, not a test: its figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from raven.transport.tunnel import Stream
from tests.support.memsession import http_open, pair


async def run(size: int, requests: int, concurrency: list[int]) -> None:
    body = b"x" * size

    async def serve(stream: Stream) -> None:
        await stream.read()
        stream.send_head(200, "OK", (("content-type", "text/plain"),))
        await stream.write(body, end=True)

    def on_open(stream: Stream) -> None:
        asyncio.get_running_loop().create_task(serve(stream))

    gw, ag, tasks = await pair(on_open, window=256 * 1024)

    async def worker(n: int) -> None:
        for _ in range(n):
            stream = gw.open_stream(http_open())
            await stream.head()
            while await stream.read():
                pass

    try:
        for conc in concurrency:
            await asyncio.gather(*(worker(10) for _ in range(conc)))  # warm up
            per = max(1, requests // conc)
            start = time.process_time()
            await asyncio.gather(*(worker(per) for _ in range(conc)))
            used = time.process_time() - start
            print(f"concurrency {conc:>3}: {used / (per * conc) * 1e6:7.0f} us CPU per scrape ({per * conc} scrapes)")
    finally:
        for s in (gw, ag):
            await s.close("benchmark over")
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=51200, help="body bytes per scrape (default 51200)")
    p.add_argument("--requests", type=int, default=4000, help="scrapes per concurrency (default 4000)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 1], help="workers (default 32 1)")
    args = p.parse_args()
    asyncio.run(run(args.size, args.requests, args.concurrency))


if __name__ == "__main__":
    main()
