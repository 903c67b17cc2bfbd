"""The tunnel port's connection guard and a session: the guard's head deadline (``limits.handshake_timeout``)
bounds the TLS handshake and the upgrade request, never a session that outlives it. The tunnel handler tells the
guard itself that its request is being served (gateway/tunnel.py), with no wrapping coroutine per session."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from raven.demo.launch import LocalCluster, PoolSpec
from raven.protocol import wire
from tests.support.agentpeer import Peer
from tests.support.metrics import metric_values

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

HEAD_DEADLINE = 1.0


async def test_a_session_outlives_the_tunnel_ports_head_deadline(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, [PoolSpec("pool-g", [], agents=1)], gateway_settings={
        "limits": {"handshake_timeout": HEAD_DEADLINE, "heartbeat_interval": 0.5, "heartbeat_timeout": 5}})
    try:
        cluster.make_pki()
        await cluster.start_gateway()
        async with Peer(cluster, "agent-pool-g-1") as peer:
            assert isinstance(await peer.connect(), wire.Welcome)
            loop = asyncio.get_running_loop()
            end = loop.time() + 3 * HEAD_DEADLINE
            pings = 0
            while loop.time() < end:  # the session answers the gateway's heartbeats, three head deadlines long
                frame = await peer.receive(timeout=2)
                assert isinstance(frame, wire.Ping), frame
                pings += 1
                await peer.send(wire.encode(wire.Pong(frame.opaque)))
            sessions = await metric_values(cluster.gateway_metrics_port, "raven_gateway_sessions")
            assert pings >= 4 and sessions == {(("pool", "pool-g"),): 1.0}
        # A connection that never sends its request is still cut at the deadline.
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.tunnel_port)
        try:
            assert await asyncio.wait_for(reader.read(), 3 * HEAD_DEADLINE) == b""
        finally:
            writer.close()
    finally:
        await cluster.close()
