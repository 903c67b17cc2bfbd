"""The layer-3 testbed: IP between a cloud pod and edge nodes behind NAT, carried only by Raven's tunnel.

    sudo .venv/bin/python -m tests.support.l3testbed run    # build it, start everything, wait for Ctrl-C
    sudo .venv/bin/python -m tests.support.l3testbed demo   # build it, ping, transfer, print, tear down

Namespaces and addresses come from ``deploy/testbed/topology.sh l3 up`` (prefix ``r3-``, independent of the
layer-7 testbed in :mod:`tests.support.testbed`)::

    r3-pod 10.212.0.10 ── r3-cloud: raven gateway (TUN raven0 10.212.255.1/32; cloud CIDR 10.212.0.0/16)
                               │ 10.230.0.1 on r3-wan ("the internet")
              r3-a-rtr (NAT) ──┴── r3-b-rtr (NAT)
       LAN 10.220.1.0/24               LAN 10.221.1.0/24
       r3-a-gw .2: agent-a-1 (raven0), agent-a-2 (raven1)    r3-b-gw .2: agent-b-1 (raven0)
       r3-a-n1 .11: raven routes --gateway 10.220.1.2 --cidr 10.212.0.0/16

Site a's pool ``site-a`` owns 10.220.0.0/16 (config and certificates); site b's gateway configuration lists
10.221.0.0/16 and 10.222.0.0/16 but its agent's certificate only 10.221.0.0/16, so only that one is routed.
Layer 7 runs too: simulated dcgm-exporters on gpu-a-1 (r3-a-n1) and gpu-b-1 (r3-b-gw), scraped through the
gateway's front end, which this host reaches (with the gateway's ops port) over an observer link at 10.229.0.2.

Everything this module starts is stopped by :meth:`L3Testbed.close` (SIGTERM to Raven's processes first, so that
they remove what they installed, then SIGKILL), and the namespaces are deleted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from raven import pki
from raven.aio import stop_process
from raven.layer3.config import RAVEN_PROTO, RAVEN_TABLE
from tests.support.errors import TestbedError
from tests.support.paths import ROOT
from tests.support.testbed import TOPOLOGY, Process

PREFIX = "r3"
CLOUD_NS, POD_NS = f"{PREFIX}-cloud", f"{PREFIX}-pod"
OBSERVER_IP = "10.229.0.2"
GATEWAY_WAN_IP = "10.230.0.1"
POD_IP = "10.212.0.10"
CLOUD_POD_LINK_IP = "10.212.0.1"  # the cloud namespace's side of the pod's veth (the pod's default route)
CLOUD_CIDR = "10.212.0.0/16"
GATEWAY_TUN = "10.212.255.1/32"
GATEWAY_OPS = f"http://{OBSERVER_IP}:10265"
FRONT = f"http://{OBSERVER_IP}:9400"
HEARTBEAT_TIMEOUT = 3.0
TOOLS = [sys.executable, "-m", "tests.support.l3tools"]
ROGUE = "rogue-a"  # an agent certificate of site a for tests.support.l3rogue
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class L3Agent:
    name: str
    device: str
    address: str  # ADDRESS/32 on its device, inside its pool's CIDR
    metrics_port: int
    namespace: str | None = None  # its gateway node, if not the site's first (L3Site.gw_ns)


@dataclass
class L3Site:
    name: str  # a, b
    cidr: str  # the pool's CIDR, in the config and in the certificates
    gw_ip: str  # the gateway node's LAN address
    agents: list[L3Agent]
    exporter: tuple[str, str, str]  # (node name, namespace, address): a simulated dcgm-exporter on :9400
    extra_config_cidrs: list[str] = field(default_factory=list)  # in the gateway's config, not the certificate
    routed_node: tuple[str, str] | None = None  # (namespace, address) of a node reached through raven routes
    lan_address: str | None = None  # the pool's floating LAN address (layer3.lan_address), ADDRESS/PREFIX
    spare_agents: list[L3Agent] = field(default_factory=list)  # configured, started only by the tests that use them

    @property
    def pool(self) -> str:
        return f"site-{self.name}"

    @property
    def gw_ns(self) -> str:
        return f"{PREFIX}-{self.name}-gw"

    @property
    def next_hop(self) -> str:
        """What ``raven routes`` on the site's other nodes routes through: the floating address, if any."""
        return self.lan_address.split("/")[0] if self.lan_address else self.gw_ip

    def namespace_of(self, agent: L3Agent) -> str:
        return agent.namespace or self.gw_ns


def default_sites() -> list[L3Site]:
    return [
        L3Site("a", "10.220.0.0/16", "10.220.1.2",
               [L3Agent("agent-a-1", "raven0", "10.220.255.1/32", 10266),
                L3Agent("agent-a-2", "raven1", "10.220.255.2/32", 10267)],
               ("gpu-a-1", f"{PREFIX}-a-n1", "10.220.1.11"), routed_node=(f"{PREFIX}-a-n1", "10.220.1.11"),
               lan_address="10.220.1.100/24",
               # On a second gateway node of site a (deploy/testbed/topology.sh l3: r3-a-gw2, 10.220.1.3).
               spare_agents=[L3Agent("agent-a-3", "raven0", "10.220.255.3/32", 10268, namespace=f"{PREFIX}-a-gw2")]),
        L3Site("b", "10.221.0.0/16", "10.221.1.2", [L3Agent("agent-b-1", "raven0", "10.221.255.1/32", 10266)],
               ("gpu-b-1", f"{PREFIX}-b-gw", "10.221.1.2"), extra_config_cidrs=["10.222.0.0/16"]),
    ]


@dataclass
class Result:
    rc: int
    out: str
    err: str

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.splitlines() if line.startswith("{")]


class L3Testbed:
    __test__ = False  # not a pytest test class

    def __init__(self, workdir: Path | None = None) -> None:
        self.own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="raven-l3-testbed-"))
        self.certs = self.workdir / "pki"
        self.token = secrets.token_hex(16)
        self.token_file = self.workdir / "front-token"
        self.sites = default_sites()
        self.processes: dict[str, Process] = {}
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": PATH}

    @property
    def site_a(self) -> L3Site:
        return self.sites[0]

    @property
    def site_b(self) -> L3Site:
        return self.sites[1]

    # ------------------------------------------------------------ topology and files

    @staticmethod
    async def topology(*args: str) -> None:
        if os.geteuid() != 0:
            raise TestbedError("the layer-3 testbed needs root (network namespaces, TUN): run it as root or with sudo")
        proc = await asyncio.create_subprocess_exec(
            "bash", str(TOPOLOGY), "l3", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise TestbedError(f"topology.sh l3 {' '.join(args)} failed: {out.decode(errors='replace').strip()}")

    def _write(self, name: str, tree: dict[str, Any]) -> Path:
        path = self.workdir / name
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        return path

    def tls(self, name: str) -> dict[str, str]:
        return {"cert": str(self.certs / f"{name}.pem"), "key": str(self.certs / f"{name}-key.pem"),
                "ca": str(self.certs / "ca.pem")}

    def make_files(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        pki.create_ca(self.certs, common_name="Raven layer-3 testbed CA")
        pki.issue(self.certs, self.certs, "gateway", "raven-gateway", dns_names=["raven-gateway"],
                  ip_addresses=[GATEWAY_WAN_IP], days=2)
        for site in self.sites:
            for agent in [*site.agents, *site.spare_agents]:
                pki.issue(self.certs, self.certs, "agent", agent.name, pools=[site.pool], cidrs=[site.cidr], days=2)
        # A certificate for tests.support.l3rogue: a compromised agent of site a.
        pki.issue(self.certs, self.certs, "agent", ROGUE, pools=[self.site_a.pool], cidrs=[self.site_a.cidr], days=2)
        self.token_file.write_text(self.token + "\n")
        self.token_file.chmod(0o600)
        self._write("gateway.yaml", {
            "replica_id": "cloud-1",
            "tunnel": {"listen": f"{GATEWAY_WAN_IP}:10262"},
            "front": {"listen": f"{OBSERVER_IP}:9400", "allowed_ports": [9400], "request_timeout": 10,
                      "auth": {"token_files": [str(self.token_file)]}},
            "metrics_listen": f"{OBSERVER_IP}:10265",
            "tls": self.tls("raven-gateway"),
            "limits": {"heartbeat_interval": 1, "heartbeat_timeout": HEARTBEAT_TIMEOUT},
            "ready_settle": 0.5,
            "drain_linger": 0.5,
            "drain_grace": 5,
            "layer3": {
                "enabled": True,
                "device": "raven0",
                "addresses": [GATEWAY_TUN],
                "cloud_cidrs": [CLOUD_CIDR],
                "pools": {s.pool: {"cidrs": [s.cidr, *s.extra_config_cidrs]} for s in self.sites},
            },
        })
        for site in self.sites:
            node, _, address = site.exporter
            for agent in [*site.agents, *site.spare_agents]:
                self._write(f"{agent.name}.yaml", {
                    "pool": site.pool,
                    "gateway": {"url": f"wss://{GATEWAY_WAN_IP}:10262/tunnel", "server_name": "raven-gateway",
                                "backoff_initial": 0.2, "backoff_max": 1.0},
                    "nodes": [{"name": node, "address": address}],
                    "allowed_ports": [9400],
                    "metrics_listen": f"127.0.0.1:{agent.metrics_port}",
                    "tls": self.tls(agent.name),
                    "limits": {"heartbeat_interval": 1, "heartbeat_timeout": HEARTBEAT_TIMEOUT},
                    "drain_grace": 5,
                    "layer3": {"enabled": True, "device": agent.device, "addresses": [agent.address],
                               "cidrs": [site.cidr, *site.extra_config_cidrs],
                               **({"lan_address": site.lan_address} if site.lan_address else {})},
                })

    # ------------------------------------------------------------ processes

    async def spawn(self, name: str, namespace: str, argv: list[str]) -> Process:
        log = self.workdir / f"{name}.log"
        p = Process(name, namespace, argv, log)
        with log.open("ab") as out:
            p.proc = await asyncio.create_subprocess_exec(
                "ip", "netns", "exec", namespace, *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                cwd=str(ROOT), env=self.env, start_new_session=True,
            )
        self.processes[name] = p
        return p

    def raven(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "raven.cli", *args]

    async def stop(self, name: str, sig: int = signal.SIGTERM, grace: float = 10.0) -> int | None:
        p = self.processes.get(name)
        if p is None or p.proc is None:
            return None
        return await stop_process(p.proc, sig, grace)

    def agent(self, name: str) -> tuple[L3Site, L3Agent]:
        for site in self.sites:
            for agent in [*site.agents, *site.spare_agents]:
                if agent.name == name:
                    return site, agent
        raise KeyError(name)

    async def start_gateway(self) -> None:
        await self.spawn("gateway", CLOUD_NS, self.raven("gateway", "--config", str(self.workdir / "gateway.yaml")))

    async def start_agent(self, name: str) -> None:
        site, agent = self.agent(name)
        await self.spawn(name, site.namespace_of(agent),
                         self.raven("agent", "--config", str(self.workdir / f"{name}.yaml")))

    async def start_routes(self, site: L3Site) -> None:
        assert site.routed_node is not None
        await self.spawn(f"routes-{site.name}", site.routed_node[0], self.raven(
            "routes", "--gateway", site.next_hop, "--cidr", CLOUD_CIDR, "--interval", "2"))

    async def start(self) -> None:
        await self.topology("up")
        self.make_files()
        for site in self.sites:
            node, ns, address = site.exporter
            await self.spawn(f"dcgm-{node}", ns, [sys.executable, "-m", "raven.demo.simexporter", "--node",
                                                  f"{node}={address}:9400"])
        await self.start_gateway()
        for site in self.sites:
            for agent in site.agents:
                await self.start_agent(agent.name)
                await asyncio.sleep(0.3)  # the first agent of a pool comes first: it is the active one
            if site.routed_node is not None:
                await self.start_routes(site)

    def raven_processes(self) -> list[str]:
        return [n for n in self.processes if n == "gateway" or n.startswith(("agent-", "routes-"))]

    async def close(self) -> None:
        # Raven's own processes first, with SIGTERM, so that they remove what they installed; then the rest.
        ravens = self.raven_processes()
        await asyncio.gather(*(self.stop(n, grace=5) for n in ravens), return_exceptions=True)
        others = [n for n in self.processes if n not in ravens]
        await asyncio.gather(*(self.stop(n, grace=3) for n in others), return_exceptions=True)
        with contextlib.suppress(TestbedError):
            await self.topology("down")

    def log(self, name: str, tail: int = 4000) -> str:
        p = self.processes.get(name)
        if p is None or not p.log.exists():
            return ""
        return p.log.read_text(errors="replace")[-tail:]

    # ------------------------------------------------------------ running things in the namespaces

    async def sh(self, namespace: str, *argv: str, timeout: float = 60) -> Result:
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", namespace, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=str(ROOT), env=self.env, start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        assert proc.returncode is not None
        return Result(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    async def sh_background(self, namespace: str, *argv: str) -> asyncio.subprocess.Process:
        """Start a command in a namespace, its stdout and stderr piped; the caller waits for it (or kills its
        process group)."""
        return await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", namespace, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=str(ROOT), env=self.env, start_new_session=True,
        )

    async def rogue(self, to: str, sources: list[str], count: int) -> dict[str, Any]:
        """Run tests.support.l3rogue from site a's gateway node: a compromised agent of site a sending
        ``count`` UDP packets to ``to`` from each of ``sources``. Returns its JSON report."""
        site = self.site_a
        argv = [sys.executable, "-m", "tests.support.l3rogue", "--url", f"wss://{GATEWAY_WAN_IP}:10262/tunnel",
                "--certs", str(self.certs), "--name", ROGUE, "--pool", site.pool, "--cidr", site.cidr, "--to", to,
                "--count", str(count)]
        for src in sources:
            argv += ["--src", src]
        r = await self.sh(site.gw_ns, *argv, timeout=60)
        if r.rc != 0 or not r.json_lines():
            raise TestbedError(f"rogue agent failed ({r.rc}): {r.err[-2000:]}")
        return r.json_lines()[-1]

    async def ping(self, namespace: str, address: str, count: int = 3, interval: float = 0.2,
                   wait: float = 2.0, size: int = 56) -> dict[str, float]:
        """Ping; returns transmitted, received and RTT min/avg/max/mdev in ms (NaN when nothing came back)."""
        r = await self.sh(namespace, "ping", "-n", "-q", "-c", str(count), "-i", f"{interval:g}", "-W", f"{wait:g}",
                          "-s", str(size), address, timeout=count * interval + wait + 10)
        return parse_ping(r.out)

    async def ip_json(self, namespace: str, *argv: str) -> list[dict[str, Any]]:
        r = await self.sh(namespace, "ip", "-j", *argv)
        if r.rc != 0:
            raise TestbedError(f"ip {' '.join(argv)} in {namespace}: {r.err.strip()}")
        data: list[dict[str, Any]] = json.loads(r.out) if r.out.strip() else []
        return data

    async def raven_routes(self, namespace: str) -> list[str]:
        """Every route with Raven's protocol number (82), as 'DST dev DEV' / 'DST via GW table T'."""
        out = []
        for family in ("-4", "-6"):
            for r in await self.ip_json(namespace, family, "route", "show", "table", "all", "proto", str(RAVEN_PROTO)):
                how = f"via {r['gateway']}" if r.get("gateway") else f"dev {r.get('dev')}"
                table = f" table {r['table']}" if r.get("table", "main") != "main" else ""
                out.append(f"{r['dst']} {how}{table}")
        return sorted(out)

    async def raven_rules(self, namespace: str) -> list[str]:
        out = []
        for family in ("-4", "-6"):
            for r in await self.ip_json(namespace, family, "rule", "show"):
                if str(r.get("table")) == str(RAVEN_TABLE):
                    out.append(f"{r['priority']}: lookup {r['table']}")
        return out

    async def tun_devices(self, namespace: str) -> list[str]:
        links = await self.ip_json(namespace, "-d", "link", "show")
        return sorted(link["ifname"] for link in links if link.get("linkinfo", {}).get("info_kind") == "tun")

    async def leftovers(self) -> dict[str, list[str]]:
        """Per namespace of the testbed: TUN devices, Raven's routes and rules, floating LAN addresses still there."""
        names = [n for n in (await self._netns_list()) if n.startswith(f"{PREFIX}-")]
        floating = {s.lan_address.split("/")[0] for s in self.sites if s.lan_address}
        out: dict[str, list[str]] = {}
        for ns in names:
            found = [f"device {d}" for d in await self.tun_devices(ns)]
            found += [f"route {r}" for r in await self.raven_routes(ns)]
            found += [f"rule {r}" for r in await self.raven_rules(ns)]
            found += [f"address {a}" for a in await self.addresses(ns) if a.split(" ")[0] in floating]
            if found:
                out[ns] = found
        return out

    async def addresses(self, namespace: str) -> list[str]:
        """The namespace's IPv4 addresses, as 'ADDRESS LABEL'."""
        return [f"{a['local']} {a.get('label', '')}" for link in await self.ip_json(namespace, "-4", "addr", "show")
                for a in link.get("addr_info", [])]

    async def holders(self, address: str) -> list[str]:
        """The testbed namespaces that have ``address``."""
        names = [n for n in (await self._netns_list()) if n.startswith(f"{PREFIX}-")]
        return [ns for ns in names if any(a.split(" ")[0] == address for a in await self.addresses(ns))]

    @staticmethod
    async def _netns_list() -> list[str]:
        proc = await asyncio.create_subprocess_exec("ip", "netns", "list", stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        return [line.split()[0] for line in out.decode().splitlines() if line.strip()]

    # ------------------------------------------------------------ the gateway's and agents' figures

    async def _get(self, url: str, headers: dict[str, str] | None = None, timeout: float = 5) -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            async with http.get(url, headers=headers) as resp:
                return resp.status, await resp.text()

    async def gateway_metrics(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        status, text = await self._get(GATEWAY_OPS + "/metrics", {"Authorization": f"Bearer {self.token}"})
        if status != 200:
            raise TestbedError(f"gateway /metrics answered {status}")
        return parse_metrics(text)

    async def agent_metrics(self, name: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        site, agent = self.agent(name)
        r = await self.sh(site.namespace_of(agent), sys.executable, "-c",
                          "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
                          f"'http://127.0.0.1:{agent.metrics_port}/metrics', timeout=5).read().decode())")
        if r.rc != 0:
            raise TestbedError(f"{name}'s /metrics: {r.err.strip()[-500:]}")
        return parse_metrics(r.out)

    async def status(self) -> Any:
        status, text = await self._get(GATEWAY_OPS + "/status", {"Authorization": f"Bearer {self.token}",
                                                                  "Accept": "application/json"})
        if status != 200:
            raise TestbedError(f"gateway /status answered {status}")
        return json.loads(text)

    async def active_agent(self, pool: str) -> str | None:
        gauge = (await self.gateway_metrics()).get("raven_gateway_layer3_active_agent", {})
        active = [dict(labels)["agent"] for labels, v in gauge.items() if dict(labels).get("pool") == pool and v == 1]
        if len(active) > 1:
            raise TestbedError(f"two active agents in {pool}: {active}")
        return active[0] if active else None

    async def scrape(self, node: str, timeout: float = 5) -> tuple[int, float]:
        """A layer-7 scrape through the gateway's front end (Host-header mode): status and seconds."""
        start = time.monotonic()
        status, text = await self._get(FRONT + "/metrics", {"Host": f"{node}:9400",
                                                            "Authorization": f"Bearer {self.token}"}, timeout)
        if status == 200 and "DCGM_FI_DEV_GPU_UTIL" not in text:
            status = 598  # a 200 without the exporter's metrics is no scrape
        return status, time.monotonic() - start

    # ------------------------------------------------------------ waiting

    async def wait_ready(self, timeout: float = 60.0) -> float:
        """Until each pool has an active agent, the node routed by raven routes reaches the cloud pod, and the
        cloud pod reaches every site's gateway node: the whole layer-3 path works."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        last: object = None
        while loop.time() - start < timeout:
            try:
                active = {s.pool: await self.active_agent(s.pool) for s in self.sites}
                last = active
                if all(active.values()):
                    pings = [await self.ping(POD_NS, s.gw_ip, count=1, wait=1) for s in self.sites]
                    for s in self.sites:
                        if s.routed_node is not None:
                            pings.append(await self.ping(s.routed_node[0], POD_IP, count=1, wait=1))
                    last = pings
                    if all(p["received"] == 1 for p in pings):
                        return loop.time() - start
            except (aiohttp.ClientError, TimeoutError, TestbedError, ValueError) as exc:
                last = exc
            await asyncio.sleep(0.3)
        raise TestbedError(f"layer 3 not ready within {timeout:.0f}s (last: {last!r}); logs in {self.workdir}")

    # ------------------------------------------------------------ measuring

    async def iperf3(self, server_ns: str, server_ip: str, client_ns: str, seconds: float = 3,
                     port: int = 5201, reverse: bool = False, parallel: int = 1) -> dict[str, float]:
        """TCP throughput from ``client_ns`` to ``server_ip`` (``reverse``: the other way): bits/s received,
        retransmits."""
        server = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", server_ns, "iperf3", "-s", "-1", "-B", server_ip, "-p", str(port),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
        try:
            await asyncio.sleep(0.3)
            args = ["iperf3", "-c", server_ip, "-p", str(port), "-t", f"{seconds:g}", "-P", str(parallel), "-J"]
            if reverse:
                args.append("-R")
            r = await self.sh(client_ns, *args, timeout=seconds + 30)
            data = json.loads(r.out) if r.out.strip().startswith("{") else {}
            if r.rc != 0 or "end" not in data:
                raise TestbedError(f"iperf3 {server_ns} <- {client_ns} failed: {data.get('error') or r.err}")
            end = data["end"]
            return {"bits_per_second": float(end["sum_received"]["bits_per_second"]),
                    "retransmits": float(end.get("sum_sent", {}).get("retransmits", 0))}
        finally:
            if server.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGKILL)
            await server.wait()

    async def transfer(self, recv_ns: str, recv_ip: str, send_ns: str, nbytes: int, port: int = 5001,
                       rate: float = 0.0) -> tuple[dict[str, Any], dict[str, Any]]:
        """Send ``nbytes`` of random data over TCP; returns (sender's, receiver's) final figures (bytes, sha256,
        seconds)."""
        recv = await self.start_receiver(recv_ns, recv_ip, port)
        send = await self.sh(send_ns, *TOOLS, "send", "--to", f"{recv_ip}:{port}", "--bytes", str(nbytes),
                             "--rate", str(rate), timeout=300)
        out, err = await asyncio.wait_for(recv.communicate(), 60)
        if send.rc != 0 or recv.returncode != 0:
            raise TestbedError(f"transfer failed: sender {send.rc} {send.err[-1000:]}; receiver {recv.returncode} "
                               f"{err.decode()[-1000:]}")
        received = [json.loads(line) for line in out.decode().splitlines() if '"done"' in line]
        return send.json_lines()[-1], received[-1]

    async def start_receiver(self, ns: str, ip: str, port: int) -> asyncio.subprocess.Process:
        recv = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, *TOOLS, "recv", "--listen", f"{ip}:{port}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT), env=self.env,
            start_new_session=True,
        )
        assert recv.stdout is not None
        line = await asyncio.wait_for(recv.stdout.readline(), 15)  # {"event": "listening"}: no race
        if b"listening" not in line:
            raise TestbedError(f"receiver did not start: {line!r}")
        return recv


def parse_metrics(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def metric_sum(metrics: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float:
    return sum(v for k, v in metrics.get(name, {}).items() if all(dict(k).get(a) == b for a, b in labels.items()))


_PING_COUNTS = re.compile(r"(\d+) packets transmitted, (\d+) (?:packets )?received")
_PING_RTT = re.compile(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms")


def parse_ping(text: str) -> dict[str, float]:
    counts = _PING_COUNTS.search(text)
    rtt = _PING_RTT.search(text)
    nan = float("nan")
    return {
        "transmitted": float(counts[1]) if counts else 0.0,
        "received": float(counts[2]) if counts else 0.0,
        "min": float(rtt[1]) if rtt else nan, "avg": float(rtt[2]) if rtt else nan,
        "max": float(rtt[3]) if rtt else nan, "mdev": float(rtt[4]) if rtt else nan,
    }


def gaps(timestamps: list[float]) -> float:
    """The longest interval between consecutive timestamps (0 with fewer than two)."""
    return max((b - a for a, b in itertools.pairwise(timestamps)), default=0.0)


# ---------------------------------------------------------------- the demo (scripts/l3-demo.sh)


async def demo(bed: L3Testbed, megabytes: int) -> bool:
    site = bed.site_a
    assert site.routed_node is not None
    node_ns, node_ip = site.routed_node
    took = await bed.wait_ready(90)
    print(f"l3-demo: layer 3 up after {took:.1f}s; active agents: "
          f"{ {s.pool: await bed.active_agent(s.pool) for s in bed.sites} }")
    print(f"l3-demo: routes the gateway installed in {CLOUD_NS}: {await bed.raven_routes(CLOUD_NS)}")
    print(f"l3-demo: raven routes on {node_ns}: {await bed.raven_routes(node_ns)} {await bed.raven_rules(node_ns)}")
    ping = await bed.ping(POD_NS, node_ip, count=10, interval=0.1)
    direct = await bed.ping(POD_NS, CLOUD_POD_LINK_IP, count=10, interval=0.1)
    ping_ok = ping["received"] == ping["transmitted"] > 0
    print(f"l3-demo: ping {POD_IP} (cloud pod) -> {node_ip} (edge node behind NAT, site a): "
          f"{ping['received']:.0f}/{ping['transmitted']:.0f} replies, RTT avg {ping['avg']:.3f} ms "
          f"(min {ping['min']:.3f}, max {ping['max']:.3f}); over the pod's own veth: avg {direct['avg']:.3f} ms")
    xfer_ok = False
    try:
        sent, got = await bed.transfer(node_ns, node_ip, POD_NS, megabytes * 1024 * 1024)
        xfer_ok = sent["sha256"] == got["sha256"] and sent["bytes"] == got["bytes"]
        mbit = got["bytes"] * 8 / got["seconds"] / 1e6
        print(f"l3-demo: TCP {POD_IP} -> {node_ip}: {got['bytes'] / 2**20:.0f} MiB in {got['seconds']:.2f}s = "
              f"{mbit:.0f} Mbit/s; sha256 {'matches' if xfer_ok else 'DIFFERS'} ({got['sha256'][:16]}...)")
    except (TestbedError, TimeoutError) as exc:
        print(f"l3-demo: TCP transfer failed: {exc}")
    m = await bed.gateway_metrics()
    print("l3-demo: gateway counters: packets to/from site-a "
          f"{metric_sum(m, 'raven_gateway_layer3_packets_total', pool='site-a', direction='to_pool'):.0f}/"
          f"{metric_sum(m, 'raven_gateway_layer3_packets_total', pool='site-a', direction='from_pool'):.0f}, "
          f"drops {metric_sum(m, 'raven_gateway_layer3_drops_total'):.0f}")
    return ping_ok and xfer_ok


async def _run(args: argparse.Namespace) -> int:
    bed = L3Testbed(Path(args.workdir) if args.workdir else None)
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)
    code = 1
    try:
        print(f"l3-testbed: building namespaces and starting processes (logs in {bed.workdir})", flush=True)
        await bed.start()
        if args.command == "demo":
            code = 0 if await demo(bed, args.megabytes) else 1
        else:
            took = await bed.wait_ready(90)
            print(f"l3-testbed: layer 3 ready after {took:.1f}s")
            print(f"  try: sudo ip netns exec {POD_NS} ping {bed.site_a.exporter[2]}")
            print(f"       sudo ip netns exec {CLOUD_NS} ip route show proto {RAVEN_PROTO}")
            print(f"       curl {GATEWAY_OPS}/metrics | grep layer3")
            print("Press Ctrl-C to tear everything down.")
            await asyncio.Event().wait()
    except asyncio.CancelledError:
        print("l3-testbed: interrupted", file=sys.stderr)
        code = 130
    except (TestbedError, TimeoutError) as exc:
        print(f"l3-testbed: {exc}", file=sys.stderr)
    finally:
        await asyncio.shield(bed.close())
        if code == 0 and bed.own_workdir:
            shutil.rmtree(bed.workdir, ignore_errors=True)
            print("l3-testbed: torn down")
        else:
            print(f"l3-testbed: torn down; logs kept in {bed.workdir}")
    return code


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.l3testbed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "demo"],
                        help="run: stay up until Ctrl-C; demo: ping, a TCP transfer, the figures, tear down")
    parser.add_argument("--workdir", help="folder for certificates, configs and logs (default: a new temp folder)")
    parser.add_argument("--megabytes", type=int, default=32, help="size of the demo's TCP transfer (MiB)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("l3-testbed: needs root (network namespaces, TUN devices): run it as root or with sudo",
              file=sys.stderr)
        return 1
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())


