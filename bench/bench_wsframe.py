"""Benchmark: CPU per scrape through two tunnel sessions over a real WebSocket, aiohttp's framing against the
core's (issue 31 item 3), interleaved in one process.

One aiohttp server and one aiohttp client on loopback TCP (no TLS: its cost is the same either way), on uvloop
as the services run where it is installed, do the Upgrade; then the gateway's and the agent's sessions
(raven/transport/tunnel.py, the real handshake of raven/transport/connect.py) run over either

- ``aiohttp``: aiohttp's WebSocket reader and writer (raven/transport/websocket.py: one ``send_bytes`` per
  message, one ``receive`` per message), as the services did before, or
- ``core``: the core's RFC 6455 codec on the connection's own bytes (raven/transport/wslink.py, wsupgrade.py), as
  they do now.

The agent side answers every OPEN with a --size byte body (masked on the way back: the agent is the client).
C workers scrape one after another; for each round and mode it prints the CPU time (process time, both sides
together) per scrape, then the core/aiohttp ratio of the fastest and of the median rounds. Rounds alternate the
modes, so a busy machine slows both alike.

First, the framing alone (no sockets, no session): the CPU to write and read one --size byte message as a
client (masked: the agent's answers) and a 300-byte one as a server (the gateway's requests), with aiohttp's
writer and reader (its compiled reader and mask where installed) and with the core's codec; best of 7.

    PYTHONPATH=. .venv/bin/python bench/bench_wsframe.py --concurrency 32 1 --requests 3000 --rounds 3

This is a benchmark, not a test: its figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from raven.protocol import wire
from raven.transport import wsupgrade
from raven.transport.connect import accept, connect
from raven.transport.tunnel import Stream, Tunnel
from raven.transport.websocket import WebSocketSink, messages
from tests.support.memsession import http_open

LIMITS = wire.Limits()
WELCOME = wire.Welcome(wire.SUPPORTED_VERSIONS[-1], "gw-bench", 1, heartbeat_interval=30.0, heartbeat_timeout=90.0)


async def serve_gateway(mode: str, request: web.BaseRequest, ready: asyncio.Queue[Tunnel]) -> web.StreamResponse:
    if mode == "core":
        ws: web.WebSocketResponse = wsupgrade.TunnelResponse(max_message=LIMITS.max_frame)
        await ws.prepare(request)
        link = ws.link  # type: ignore[attr-defined]
        session, _ = await accept(link, lambda hello: WELCOME, lambda err, answered: None, limits=LIMITS, timeout=10)
        await ready.put(session)
        await link.serve(session)
    else:
        ws = web.WebSocketResponse(max_msg_size=LIMITS.max_frame + 1, compress=False, autoping=True)
        await ws.prepare(request)
        sink = WebSocketSink(ws)
        session, _ = await accept(sink, lambda hello: WELCOME, lambda err, answered: None, limits=LIMITS, timeout=10)
        await ready.put(session)
        await session.run(messages(ws))
    return ws


async def round_trip(mode: str, size: int, requests: int, conc: int) -> float:
    """CPU seconds per scrape for one mode and concurrency (a fresh connection)."""
    body = b"x" * size
    ready: asyncio.Queue[Tunnel] = asyncio.Queue()
    runner = web.ServerRunner(web.Server(lambda request: serve_gateway(mode, request, ready)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/tunnel"

    async def answer(stream: Stream) -> None:
        await stream.read()
        stream.send_head(200, "OK", (("content-type", "text/plain"),))
        await stream.write(body, end=True)

    def on_open(stream: Stream) -> None:
        asyncio.get_running_loop().create_task(answer(stream))

    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(url, compress=0, max_msg_size=LIMITS.max_frame + 1)
        hello = wire.Hello("agent-bench", uuid.uuid4().hex, wire.SUPPORTED_VERSIONS)
        run: Callable[[Tunnel], Awaitable[None]]
        if mode == "core":
            link = wsupgrade.take_over(ws, max_message=LIMITS.max_frame)
            agent, _ = await connect(link, hello, limits=LIMITS, timeout=10)
            run = link.serve
        else:
            agent, _ = await connect(WebSocketSink(ws), hello, limits=LIMITS, timeout=10)

            async def run(session: Tunnel) -> None:
                await session.run(messages(ws))
        agent.on_open = on_open
        agent_task = asyncio.create_task(run(agent))
        gateway = await ready.get()

        async def worker(n: int) -> None:
            for _ in range(n):
                stream = gateway.open_stream(http_open())
                await stream.head()
                while await stream.read():
                    pass

        await asyncio.gather(*(worker(10) for _ in range(conc)))  # warm up
        per = max(1, requests // conc)
        start = time.process_time()
        await asyncio.gather(*(worker(per) for _ in range(conc)))
        used = time.process_time() - start
        await agent.close("benchmark over")
        await gateway.close("benchmark over")
        await asyncio.wait_for(agent_task, 10)
        await ws.close()
    await runner.cleanup()
    return used / (per * conc)


class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return False


class _Protocol:
    _paused = False
    _reading_paused = False

    def pause_reading(self) -> None:
        pass


async def _best_of(step: Callable[[], Awaitable[None]]) -> float:
    """CPU seconds per call of ``step``: the best of 7 runs of 200."""
    best = float("inf")
    for _ in range(7):
        start = time.process_time()
        for _ in range(200):
            await step()
        best = min(best, (time.process_time() - start) / 200)
    return best


async def codec_one(label: str, n: int, client: bool) -> None:
    from aiohttp._websocket.reader import WebSocketDataQueue, WebSocketReader
    from aiohttp._websocket.writer import WebSocketWriter

    from raven.protocol.wsframe import FrameDecoder, FrameEncoder

    message = b"m" * n
    transport = _Transport()
    writer = WebSocketWriter(_Protocol(), transport, use_mask=client)  # type: ignore[arg-type]
    queue = WebSocketDataQueue(_Protocol(), 1 << 30, loop=asyncio.get_running_loop())  # type: ignore[arg-type]
    reader = WebSocketReader(queue, 1 << 24, compress=False, decode_text=False)
    encoder = FrameEncoder(client=client, masker=wsupgrade.MASKER)
    decoder = FrameDecoder(client=not client, max_message=1 << 24, masker=wsupgrade.MASKER)

    async def theirs() -> None:
        await writer.send_frame(message, aiohttp.WSMsgType.BINARY)
        reader.feed_data(transport.out.pop())
        await queue.read()

    async def ours() -> None:
        decoder.receive(encoder.binary([message]))

    old, new = await _best_of(theirs), await _best_of(ours)
    print(f"framing alone, {label}: aiohttp {old * 1e6:.1f} us, core {new * 1e6:.1f} us per message "
          f"(write + read): core/aiohttp {new / old:.2f}", flush=True)


async def codec_only(size: int) -> None:
    """Microseconds to write and read one message with each framing."""
    await codec_one(f"{size} B, client (masked)", size, True)
    await codec_one("300 B, server", 300, False)


async def main_async(size: int, requests: int, concurrency: list[int], rounds: int) -> None:
    await codec_only(size)
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for conc in concurrency:
            for mode in (("aiohttp", "core") if r % 2 == 0 else ("core", "aiohttp")):
                per = await round_trip(mode, size, requests, conc)
                results.setdefault((mode, conc), []).append(per)
                print(f"round {r + 1} concurrency {conc:>3} {mode:>7}: {per * 1e6:6.0f} us CPU per scrape", flush=True)
    for conc in concurrency:
        old, new = results[("aiohttp", conc)], results[("core", conc)]
        print(f"concurrency {conc:>3}: best aiohttp {min(old) * 1e6:.0f} us, core {min(new) * 1e6:.0f} us per scrape: "
              f"core/aiohttp {min(new) / min(old):.2f}; medians of {rounds} {statistics.median(old) * 1e6:.0f} and "
              f"{statistics.median(new) * 1e6:.0f} us: {statistics.median(new) / statistics.median(old):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=51200, help="body bytes per scrape (default 51200)")
    p.add_argument("--requests", type=int, default=3000, help="scrapes per run (default 3000)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 1], help="workers (default 32 1)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running both modes (default 3)")
    args = p.parse_args()
    try:
        import uvloop  # the services' loop (raven/cli/runtime.py)
    except ImportError:
        asyncio.run(main_async(args.size, args.requests, args.concurrency, args.rounds))
    else:
        uvloop.run(main_async(args.size, args.requests, args.concurrency, args.rounds))


if __name__ == "__main__":
    main()
