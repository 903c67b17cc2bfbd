"""The guarded listener's shared read buffer: every connection gets its own bytes, on both event loops, with TLS.

The guard takes each connection's bytes as a buffered protocol into one buffer per thread (so that uvloop's
TLS layer decrypts into it instead of allocating per record). These tests send many large, distinct bodies at
once, over TLS and plain TCP, bigger than that buffer, and check that each handler saw exactly its own body.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from raven.config import TLSConfig
from raven.demo.launch import free_port
from raven.http.guard import READ_BUFFER, ConnectionGuard, GuardLimits
from raven.http.listener import GuardedSite, guarded_handler
from raven.transport.tls import client_context, server_context
from tests.support.listenerbed import listener_pki, loops

CLIENTS = 24
BODY = READ_BUFFER + 123_457  # more than the shared buffer: reads span several fills




@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return listener_pki(tmp_path_factory.mktemp("pki"))


async def exchange(tls: TLSConfig | None, client_tls: TLSConfig | None) -> list[tuple[str, str]]:
    guard = ConnectionGuard("test listener", GuardLimits())

    async def digest(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(text=hashlib.sha256(await request.read()).hexdigest())

    server = web.Server(guarded_handler(guard, digest), client_max_size=4 * BODY)
    runner = web.ServerRunner(server)
    await runner.setup()
    port = free_port("127.0.0.1")
    site = GuardedSite(runner, "127.0.0.1", port, guard, ssl_context=server_context(tls) if tls else None)
    await site.start()
    try:
        scheme = "https" if tls else "http"
        ssl_ctx = client_context(client_tls) if client_tls else False
        bodies = [os.urandom(BODY) for _ in range(CLIENTS)]

        async def one(body: bytes) -> tuple[str, str]:
            # A connection each, so that the reads of many connections interleave on the loop.
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_ctx, force_close=True)) as s:
                async with s.post(f"{scheme}://127.0.0.1:{port}/", data=body,
                                  timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    assert resp.status == 200, await resp.text()
                    return hashlib.sha256(body).hexdigest(), await resp.text()

        return await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), 60)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("use_tls", [True, False], ids=["tls", "plain"])
@pytest.mark.parametrize("loop_name,factory", loops(), ids=[name for name, _ in loops()])
def test_each_connection_reads_its_own_bytes(
    pki_dir: Path, use_tls: bool, loop_name: str, factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    tls = TLSConfig(cert=pki_dir / "gw.pem", key=pki_dir / "gw-key.pem", ca=pki_dir / "ca.pem") if use_tls else None
    client_tls = TLSConfig(cert=pki_dir / "agent-1.pem", key=pki_dir / "agent-1-key.pem",
                           ca=pki_dir / "ca.pem") if use_tls else None
    with asyncio.Runner(loop_factory=factory) as runner:
        results = runner.run(exchange(tls, client_tls))
    assert len(results) == CLIENTS
    for sent, seen in results:
        assert seen == sent
