"""What the integration tests share: loopback hosts and ports for simulated nodes, an echo node, the bed."""

from __future__ import annotations

from aiohttp import web

from raven.demo.launch import LocalCluster, free_port
from raven.demo.simexporter import SimExporter

# Tests use 127.0.10.0/24 so they never clash with the demo (127.0.0.x).
HOSTS = [f"127.0.10.{i}" for i in range(2, 12)]


def pick_node_port(hosts: list[str]) -> int:
    return free_port("127.0.0.1", tuple(hosts))


async def start_echo(host: str, port: int, seen: list[dict[str, str]]) -> web.AppRunner:
    """A node that answers every GET with 200 and records the request headers it received."""

    async def echo(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.Response(text="echo\n")

    app = web.Application()
    app.router.add_get("/{tail:.*}", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


class Bed:
    """A running cluster plus its exporter, and the pools by name."""

    def __init__(self, cluster: LocalCluster, exporter: SimExporter, port: int, tcp_port: int) -> None:
        self.cluster = cluster
        self.exporter = exporter
        self.port = port
        self.tcp_port = tcp_port
        self.pools = {p.name: p for p in cluster.pools}

    async def restore(self) -> None:
        """Bring every agent back after a test killed some; reset exporter modes."""
        for pool in self.cluster.pools:
            for node in pool.nodes:
                self.exporter.set_mode(node.name, "ok")
            for name in self.cluster.agent_names(pool):
                proc = self.cluster.agents.get(name)
                if proc is None or not proc.running:
                    await self.cluster.start_agent(pool, name)
        await self.cluster.wait_registered(30)
