"""A stand-in for a Kubernetes Service (kube-proxy) in the netns testbed, run as a process in the cloud namespace.

    python -m tests.support.servicelb --address 10.200.0.1 --port 9400 --port 9100 --port 10265 \
        --backend 10.200.0.11 --backend 10.200.0.12 --probe-port 10265 --status 10.199.0.2:10270

What it does is what kube-proxy does for a ClusterIP Service, at the level a test can see:

- every **new** connection to ``address:port`` goes to one backend chosen at random among the **ready** ones
  (kube-proxy's iptables mode picks an endpoint at random per connection); with none ready it is refused;
- a backend is ready while ``GET http://backend:probe-port/readyz`` answers 200, probed every ``--period``
  seconds (a readiness probe with failureThreshold 1; the endpoint controller's delay is not modelled);
- a connection, once made, stays with its backend whatever becomes of the backend's readiness (conntrack);
- a backend that refuses the connection is not replaced by another one: the client's connection is reset, as a
  SYN DNATed to a closed port gets a reset (and with no endpoint ready, kube-proxy rejects the SYN);
- what a peer ends its connection with reaches the other peer (the NAT passes every segment on): a FIN as a
  FIN (a half close), a reset as a reset (tests.support.tcplb.pipe), so that a client whose backend reset
  sees it at once instead of waiting for its timeout.

``--status HOST:PORT`` serves ``GET /endpoints``: ``{"10.200.0.11": true, ...}``, the Service's endpoints as
``kubectl get endpoints`` would list them (ready or not), for tests to wait on. The process stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import random
import signal
import sys

import aiohttp
from aiohttp import web

from raven.aio import reset_connection
from tests.support.tcplb import pipe


class ServiceBalancer:
    def __init__(self, address: str, ports: list[int], backends: list[str], probe_port: int, period: float) -> None:
        self.address = address
        self.ports = ports
        self.backends = backends
        self.probe_port = probe_port
        self.period = period
        self.ready: dict[str, bool] = dict.fromkeys(backends, False)
        self.connections: dict[str, int] = dict.fromkeys(backends, 0)
        self.refused = 0
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._rng = random.Random()

    async def start(self) -> None:
        for port in self.ports:
            self._servers.append(await asyncio.start_server(
                functools.partial(self._handle, port=port), self.address, port, reuse_address=True))

    async def probe_forever(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.period)) as http:
            while True:
                async def probe(backend: str) -> None:
                    try:
                        async with http.get(f"http://{backend}:{self.probe_port}/readyz") as resp:
                            ok = resp.status == 200
                    except (aiohttp.ClientError, TimeoutError, OSError):
                        ok = False
                    if ok != self.ready[backend]:
                        print(f"servicelb: endpoint {backend} {'ready' if ok else 'NOT ready'}", flush=True)
                    self.ready[backend] = ok

                await asyncio.gather(*(probe(b) for b in self.backends))
                await asyncio.sleep(self.period)

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, port: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            ready = [b for b in self.backends if self.ready[b]]
            if not ready:
                self.refused += 1
                reset_connection(writer.transport)
                return
            backend = self._rng.choice(ready)
            try:
                async with asyncio.timeout(3):
                    up_reader, up_writer = await asyncio.open_connection(backend, port)
            except (OSError, TimeoutError):
                self.refused += 1
                reset_connection(writer.transport)
                return
            self.connections[backend] += 1
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            for w in (writer, up_writer):
                if w is not None:
                    w.close()


async def _main(args: argparse.Namespace) -> int:
    lb = ServiceBalancer(args.address, args.port, args.backend, args.probe_port, args.period)
    await lb.start()
    probe = asyncio.get_running_loop().create_task(lb.probe_forever())
    runner: web.AppRunner | None = None
    if args.status:
        async def endpoints(_: web.Request) -> web.Response:
            return web.json_response({"ready": lb.ready, "connections": lb.connections, "refused": lb.refused})

        app = web.Application()
        app.router.add_get("/endpoints", endpoints)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, _, port = args.status.rpartition(":")
        await web.TCPSite(runner, host, int(port)).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"servicelb: {args.address} ports {args.port} -> {args.backend}", flush=True)
    await stop.wait()
    probe.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await probe
    await lb.close()
    if runner is not None:
        await runner.cleanup()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.servicelb", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="the Service address to listen on")
    parser.add_argument("--port", type=int, action="append", required=True, help="a Service port (repeatable)")
    parser.add_argument("--backend", action="append", required=True, help="a backend address (repeatable)")
    parser.add_argument("--probe-port", type=int, required=True, help="where each backend answers /readyz")
    parser.add_argument("--period", type=float, default=0.5, help="seconds between readiness probes")
    parser.add_argument("--status", help="HOST:PORT for GET /endpoints")
    return asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
