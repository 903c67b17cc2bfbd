"""A rogue agent for the layer-3 tests: a real agent certificate, the real session layer, but packets of its own
making. It announces its pool's CIDRs like an agent, then sends IP packets with the source addresses it is told
to (``--src``, repeatable), ``--count`` of each, to ``--to`` (UDP). It stands for a compromised agent: the gateway
must not trust what an agent sends. Prints one JSON line: what it sent and the gateway's ROUTES answer.

    python -m tests.support.l3rogue --url wss://10.230.0.1:10262/tunnel --certs DIR --name rogue-a --pool site-a \\
        --cidr 10.220.0.0/16 --to 10.212.0.10:5002 --src 10.99.0.66 --src 10.220.1.99 --count 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import uuid
from pathlib import Path

import aiohttp

from raven.config import TLSConfig
from raven.protocol import wire
from raven.transport import wsupgrade
from raven.transport.connect import connect
from raven.transport.tls import client_context
from tests.support.l3tools import udp_packet


async def rogue(args: argparse.Namespace) -> int:
    certs = Path(args.certs)
    ctx = client_context(TLSConfig(cert=certs / f"{args.name}.pem", key=certs / f"{args.name}-key.pem",
                                   ca=certs / "ca.pem"))
    host, _, port = args.to.rpartition(":")
    answer: asyncio.Future[wire.Routes] = asyncio.get_running_loop().create_future()

    def on_control(frame: wire.ControlFrame) -> None:
        if isinstance(frame, wire.Routes) and not answer.done():
            answer.set_result(frame)

    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(args.url, ssl=ctx, server_hostname=args.server_name, compress=0)
        try:
            hello = wire.Hello(args.name, uuid.uuid4().hex)
            link = wsupgrade.take_over(ws, max_message=wire.DEFAULT_LIMITS.max_frame)
            session, _ = await connect(link, hello, limits=wire.DEFAULT_LIMITS, timeout=10)
            session.on_control = on_control
            reader = asyncio.create_task(link.serve(session))
            session.send_control(wire.Routes((args.cidr,), pool=args.pool))
            routes = await asyncio.wait_for(answer, 10)
            sent: dict[str, int] = {}
            for src in args.src:
                packet = udp_packet(src, host, 40000, int(port), b"raven-rogue-agent")
                for _ in range(args.count):
                    if session.send_datagram(packet):
                        sent[src] = sent.get(src, 0) + 1
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.5)  # let them leave before the session closes
            print(json.dumps({"event": "done", "sent": sent, "routes": list(routes.cidrs), "active": routes.active}),
                  flush=True)
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
        finally:
            await link.close()
            await ws.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.l3rogue", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--server-name", default="raven-gateway")
    p.add_argument("--certs", required=True, help="folder with ca.pem, NAME.pem, NAME-key.pem")
    p.add_argument("--name", required=True)
    p.add_argument("--pool", required=True)
    p.add_argument("--cidr", required=True)
    p.add_argument("--to", required=True, help="IP:PORT of the UDP packets")
    p.add_argument("--src", action="append", required=True, help="a source address to forge (repeatable)")
    p.add_argument("--count", type=int, default=10)
    return asyncio.run(rogue(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
