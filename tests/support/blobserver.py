"""Bulk traffic for the uplink testbed (issue 29 item 9): a node that serves incompressible bodies, and a client
that downloads them through the gateway, again and again until a deadline.

    python -m tests.support.blobserver serve --listen 10.201.1.101:9100 [--size 2097152]
    python -m tests.support.blobserver get --gateway 10.200.0.1:9100 --host gpu-a-1:9100 --token-file F
        --until UNIX_TIME

``serve`` answers every GET with ``--size`` random bytes (made once; TLS does not compress, and the client asks
for ``identity``, so no layer shrinks them). ``get`` prints one JSON line per download (bytes, seconds, status or
error) and stops at ``--until``; a download still running then is cut (it was load, not a measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import aiohttp
from aiohttp import web

SIZE = 2 * 1024 * 1024


async def serve(listen: str, size: int) -> None:
    body = os.urandom(size)

    async def blob(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/{tail:.*}", blob)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = listen.rsplit(":", 1)
    await web.TCPSite(runner, host, int(port)).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


async def get(gateway: str, host: str, token: str, until: float) -> None:
    headers = {"Host": host, "Authorization": f"Bearer {token}", "Accept-Encoding": "identity"}
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        while (left := until - time.time()) > 0:
            start = time.monotonic()
            got = 0
            line: dict[str, object] = {}
            try:
                async with asyncio.timeout(left):
                    async with http.get(f"http://{gateway}/blob", headers=headers) as resp:
                        async for chunk in resp.content.iter_any():
                            got += len(chunk)
                        line = {"status": resp.status}
            except TimeoutError:
                line = {"cut": True}
            except (aiohttp.ClientError, OSError) as exc:
                line = {"error": str(exc) or type(exc).__name__}
                await asyncio.sleep(1)
            print(json.dumps({**line, "bytes": got, "seconds": round(time.monotonic() - start, 3)}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.blobserver")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", required=True)
    s.add_argument("--size", type=int, default=SIZE)
    g = sub.add_parser("get")
    g.add_argument("--gateway", required=True, help="the gateway's front end, HOST:PORT")
    g.add_argument("--host", required=True, help="the node, NAME:PORT (the Host header)")
    g.add_argument("--token-file", required=True)
    g.add_argument("--until", type=float, required=True, help="Unix time to stop at")
    args = parser.parse_args()
    try:
        if args.cmd == "serve":
            asyncio.run(serve(args.listen, args.size))
        else:
            with open(args.token_file) as f:
                token = f.read().strip()
            asyncio.run(get(args.gateway, args.host, token, args.until))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
