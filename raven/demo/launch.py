"""Start a real gateway and real agents as processes on loopback (demo, tests, benchmarks).

Everything lives under one work folder: an ephemeral PKI, one YAML config per process and
one log file per process. :meth:`LocalCluster.close` stops every process it started, on
every path, and kills those that do not stop within their grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from raven import pki
from raven.aio import stop_process
from raven.demo.simexporter import SimNode
from raven.errors import ConfigError

PORT_RANGE_ENV = "RAVEN_PORT_RANGE"
_cursor: dict[tuple[int, int], int] = {}


def port_range() -> tuple[int, int] | None:
    """``RAVEN_PORT_RANGE=LOW-HIGH``: where :func:`free_port` takes ports from (None: the kernel's choice).

    A port the kernel picks (bind to port 0) comes from its ephemeral range, which every outgoing connection on
    the machine draws from as well: between the pick and the service's own bind another process's connection can
    take it ("Address already in use"). A range below the ephemeral one (``net.ipv4.ip_local_port_range``,
    32768-60999 by default) is never handed out that way; the test suite gives each of its workers a range of
    its own, so that two of them never pick the same port either."""
    text = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not text:
        return None
    low_text, sep, high_text = text.partition("-")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        low = high = 0
    if not sep or not 1024 <= low <= high <= 65535:
        raise ConfigError(f"{PORT_RANGE_ENV}={text!r}: expected LOW-HIGH, two ports from 1024 to 65535, LOW <= HIGH "
                          f"(e.g. 20000-29999, below the kernel's ephemeral range), or unset it")
    return low, high


def free_port(host: str = "127.0.0.1", also: tuple[str, ...] = ()) -> int:
    """A port free on ``host`` (and on every address in ``also``): from ``RAVEN_PORT_RANGE`` when it is set
    (in turn from a random start, so that the ports this process just handed out are the last to come again),
    else the kernel's pick."""
    span = port_range()
    if span is not None:
        low, high = span
        size = high - low + 1
        at = _cursor.get(span, int.from_bytes(os.urandom(4), "big") % size)
        for _ in range(size):
            port = low + at
            at = (at + 1) % size
            if _free(host, port) and all(_free(h, port) for h in also):
                _cursor[span] = at
                return port
        raise OSError(f"no port free on {', '.join((host, *also))} in {PORT_RANGE_ENV} {low}-{high}")
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if all(_free(h, port) for h in also):
            return port
    raise OSError(f"no port free on {host} and {', '.join(also)}")


def _free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class PoolSpec:
    name: str
    nodes: list[SimNode]
    agents: int = 2


@dataclass
class Proc:
    name: str
    process: asyncio.subprocess.Process
    log: Path
    metrics_port: int
    config: Path
    host: str = "127.0.0.1"

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class LocalCluster:
    workdir: Path
    pools: list[PoolSpec]
    allowed_ports: list[int] = field(default_factory=lambda: [9100, 9400])
    gateway_settings: dict[str, Any] = field(default_factory=dict)
    agent_settings: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # One gateway replica per address; all use the same ports, as pods behind one Service would.
    gateway_hosts: list[str] = field(default_factory=lambda: ["127.0.0.1"])
    # What agents dial; default: the first replica's address.
    gateway_url: str | None = None
    # A bearer token the front end and the inventory endpoints require (None: an open loopback front end).
    front_token: str | None = None
    # The command that runs `raven` for a process, by its name ("gateway", "agent-pool-a-1"): by default this
    # interpreter's raven.cli. A skew test runs another release's processes this way (tests/support/release.py).
    commands: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.certs = self.workdir / "pki"
        first, *rest = self.gateway_hosts
        others = tuple(rest)
        self.front_port = free_port(first, others)
        self.tunnel_port = free_port(first, others)
        self.gateway_metrics_port = free_port(first, others)
        self.gateways: list[Proc | None] = [None] * len(self.gateway_hosts)
        self.agents: dict[str, Proc] = {}

    @property
    def gateway(self) -> Proc | None:
        return self.gateways[0]

    def front_url_of(self, replica: int) -> str:
        return f"http://{self.gateway_hosts[replica]}:{self.front_port}"

    def sd_url_of(self, replica: int) -> str:
        return f"http://{self.gateway_hosts[replica]}:{self.gateway_metrics_port}/sd"

    @property
    def front_url(self) -> str:
        return self.front_url_of(0)

    @property
    def sd_url(self) -> str:
        return self.sd_url_of(0)

    def agent_names(self, pool: PoolSpec) -> list[str]:
        return [f"agent-{pool.name}-{i}" for i in range(1, pool.agents + 1)]

    # ------------------------------------------------------------ files

    def make_pki(self) -> None:
        pki.create_ca(self.certs, common_name="Raven ephemeral CA")
        pki.issue(self.certs, self.certs, "gateway", "raven-gateway", dns_names=["raven-gateway", "localhost"],
                  ip_addresses=sorted({"127.0.0.1", *self.gateway_hosts}), days=2)
        for pool in self.pools:
            for name in self.agent_names(pool):
                pki.issue(self.certs, self.certs, "agent", name, pools=[pool.name], days=2)

    def _write(self, name: str, tree: dict[str, Any]) -> Path:
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        return path

    def gateway_config(self, replica: int = 0) -> Path:
        host = self.gateway_hosts[replica]
        tree: dict[str, Any] = {
            "replica_id": f"gw-{replica + 1}",
            "replicas": len(self.gateway_hosts),
            "tunnel": {"listen": f"{host}:{self.tunnel_port}"},
            "front": {"listen": f"{host}:{self.front_port}", "allowed_ports": self.allowed_ports},
            "metrics_listen": f"{host}:{self.gateway_metrics_port}",
            "tls": {"cert": str(self.certs / "raven-gateway.pem"), "key": str(self.certs / "raven-gateway-key.pem"),
                    "ca": str(self.certs / "ca.pem")},
            "drain_grace": 5,
            "drain_linger": 0.5,
            "ready_settle": 0.5,
            # The agents' reconnect bound (their backoff_max, 2 s here, and a refused dial's moment): a replica
            # is ready this long after its start, or earlier with Kubernetes once every pool is back.
            "ready_max_wait": 3,
        }
        if self.front_token is not None:
            token_file = self.workdir / "front-token"
            token_file.write_text(self.front_token + "\n")
            token_file.chmod(0o600)
            tree["front"]["auth"] = {"token_files": [str(token_file)], "reload_interval": 0.5}
        _merge(tree, self.gateway_settings)
        return self._write(self.gateway_name(replica), tree)

    @property
    def auth_headers(self) -> dict[str, str]:
        """What a client sends to the inventory endpoints and the front end in Host-header mode."""
        return {"Authorization": f"Bearer {self.front_token}"} if self.front_token else {}

    def gateway_name(self, replica: int) -> str:
        return "gateway" if replica == 0 else f"gateway-{replica + 1}"

    def agent_config(self, pool: PoolSpec, name: str, metrics_port: int) -> Path:
        tree: dict[str, Any] = {
            "pool": pool.name,
            "gateway": {"url": self.gateway_url or f"wss://{self.gateway_hosts[0]}:{self.tunnel_port}/tunnel",
                        "server_name": "raven-gateway",
                        "backoff_initial": 0.2, "backoff_max": 2},
            "nodes": [{"name": n.name, "address": n.host} for n in pool.nodes],
            "allowed_ports": self.allowed_ports,
            "metrics_listen": f"127.0.0.1:{metrics_port}",
            "tls": {"cert": str(self.certs / f"{name}.pem"), "key": str(self.certs / f"{name}-key.pem"),
                    "ca": str(self.certs / "ca.pem")},
            "drain_grace": 5,
        }
        _merge(tree, self.agent_settings)
        return self._write(name, tree)

    # ------------------------------------------------------------ processes

    async def _spawn(
        self, name: str, args: list[str], metrics_port: int, config: Path, host: str = "127.0.0.1"
    ) -> Proc:
        log = self.workdir / f"{name}.log"
        env = {**os.environ, **self.env}
        with log.open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                *self.commands.get(name, [sys.executable, "-m", "raven.cli"]), *args,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env,
            )
        return Proc(name, process, log, metrics_port, config, host)

    async def start_gateway(self, replica: int = 0) -> Proc:
        config = self.gateway_config(replica)
        proc = await self._spawn(self.gateway_name(replica), ["gateway", "--config", str(config)],
                                 self.gateway_metrics_port, config, self.gateway_hosts[replica])
        self.gateways[replica] = proc
        await self.wait_ready(proc, path="/healthz")  # /readyz waits for agents, which start later
        return proc

    async def start_agent(self, pool: PoolSpec, name: str, wait: bool = True) -> Proc:
        old = self.agents.get(name)
        port = old.metrics_port if old is not None else free_port()
        config = self.agent_config(pool, name, port)
        proc = await self._spawn(name, ["agent", "--config", str(config)], port, config)
        self.agents[name] = proc
        if wait:
            await self.wait_ready(proc)
        return proc

    async def start(self, timeout: float = 30.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.make_pki()
        for replica in range(len(self.gateway_hosts)):
            await self.start_gateway(replica)
        starts = [self.start_agent(pool, name, wait=False) for pool in self.pools for name in self.agent_names(pool)]
        await asyncio.gather(*starts)
        for proc in self.agents.values():
            await self.wait_ready(proc, timeout)
        await self.wait_registered(timeout)
        for gateway in self.gateways:  # settled: until then a replica answers 503 (not 404) for unknown names
            if gateway is not None:
                await self.wait_ready(gateway, timeout)

    async def wait_ready(self, proc: Proc, timeout: float = 30.0, path: str = "/readyz") -> None:
        url = f"http://{proc.host}:{proc.metrics_port}{path}"
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while loop.time() < end:
                if not proc.running:
                    raise RuntimeError(f"{proc.name} exited with code {proc.process.returncode}:\n{proc.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"{proc.name} not ready within {timeout:.0f}s:\n{proc.log_tail()}")

    async def sd(self, replica: int = 0) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(self.sd_url_of(replica), headers=self.auth_headers) as resp:
                data: list[dict[str, Any]] = json.loads(await resp.text())
                return data

    async def wait_registered(
        self, timeout: float = 30.0, agents_per_node: int | None = None, replicas: list[int] | None = None
    ) -> None:
        """Wait until every node is reachable on every running replica, through ``agents_per_node``
        agents (default: all of its pool)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        want = {n.name: (agents_per_node or p.agents) for p in self.pools for n in p.nodes}
        if replicas is None:
            replicas = [i for i, g in enumerate(self.gateways) if g is not None and g.running]
        have: dict[str, int] = {}
        while loop.time() < end:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                done = True
                for replica in replicas:
                    have = {}
                    for group in await self.sd(replica):
                        labels = group["labels"]
                        if labels.get("__meta_raven_reach", "tunnel") == "tunnel":  # others need no agent
                            have[labels["node"]] = len([a for a in labels["__meta_raven_agents"].split(",") if a])
                    if not all(have.get(node, 0) >= n for node, n in want.items()):
                        done = False
                        break
                if done:
                    return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"nodes not registered within {timeout:.0f}s: want {want}, have {have}")

    async def stop(self, proc: Proc, sig: int = signal.SIGTERM, grace: float = 10.0) -> int:
        return await stop_process(proc.process, sig, grace)

    async def close(self) -> None:
        procs = list(self.agents.values()) + [g for g in self.gateways if g is not None]
        await asyncio.gather(*(self.stop(p, grace=8.0) for p in procs), return_exceptions=True)


def _merge(tree: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _merge(tree[key], value)
        else:
            tree[key] = value
