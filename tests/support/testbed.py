"""A real topology on one machine: Prometheus in a cloud network namespace scrapes GPU nodes of two
edge sites by name, where the Raven tunnel is the only way in, and an on-cloud GPU node directly.

    sudo .venv/bin/python -m tests.support.testbed run   # build it, start everything, wait for Ctrl-C, tear down

Namespaces and addresses come from ``deploy/testbed/topology.sh``. In the cloud namespace: the
gateway (front end on 10.200.0.1:9400 and :9100, the address every edge name resolves to),
dnsmasq serving the gateway's hosts file (as CoreDNS's hosts plugin would) and Debian's
Prometheus, which finds the targets through the gateway's HTTP service discovery and resolves
their names through dnsmasq. In each edge site's gateway namespace: two agents. On every GPU
node: the simulated dcgm-exporter on :9400 and Debian's prometheus-node-exporter on :9100. The
on-cloud node (pool ``cloud-1``, ``reach: direct``, namespace rv-c-n1 on the cloud's own network) runs
the same two exporters; the gateway lists it (from its configuration) in /sd with reach direct and
maps its name to its own address in the hosts file (``hosts.direct: internal-ip``), and Prometheus
scrapes it without the proxy, in jobs of its own. The simulated exporters never compress, so the
agents gzip their pages for Prometheus (``Accept-Encoding: gzip``).
Prometheus is reachable from this host at http://10.199.0.2:9090.

With ``replicas=2`` the cloud runs two gateway replicas (10.200.0.11 and .12) behind a Service at
10.200.0.1 (tests/support/servicelb.py: random per new connection among the ready replicas, as kube-proxy
does); agents dial every replica by name (``raven-gateway-tunnel``, which the cloud's dnsmasq resolves to both
addresses, as for a headless Service) and Prometheus scrapes and discovers through the Service address;
every replica has the same pools (the on-cloud one too), as replicas of one Deployment would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from raven import pki
from raven.aio import stop_process
from tests.support.errors import TestbedError
from tests.support.paths import ROOT


def shipped_node_rule() -> dict[str, Any]:
    """The shipped edge-dcgm job's relabel rule that gives a grouped /sd target its ``node`` label, as it is in
    deploy/prometheus/scrape-config.yaml: the testbed's real Prometheus runs the very rule."""
    jobs = yaml.safe_load((ROOT / "deploy/prometheus/scrape-config.yaml").read_text())["scrape_configs"]
    edge = next(j for j in jobs if j["job_name"] == "edge-dcgm")
    rule: dict[str, Any] = next(r for r in edge["relabel_configs"] if r.get("target_label") == "node")
    return rule

def shipped_storage() -> dict[str, Any]:
    """The shipped configuration's storage section (the out-of-order window backfill needs), as it is in
    deploy/prometheus/scrape-config.yaml."""
    storage: dict[str, Any] = yaml.safe_load((ROOT / "deploy/prometheus/scrape-config.yaml").read_text())["storage"]
    return storage


TOPOLOGY = ROOT / "deploy" / "testbed" / "topology.sh"
CLOUD_IP = "10.200.0.1"
OBSERVER_IP = "10.199.0.2"
PROMETHEUS = f"http://{OBSERVER_IP}:9090"
GATEWAY_OPS = f"http://{OBSERVER_IP}:10265"
SERVICE_STATUS = f"http://{OBSERVER_IP}:10270/endpoints"  # replicas mode: the Service's endpoints
REPLICA_IPS = ["10.200.0.11", "10.200.0.12"]
TUNNEL_NAME = "raven-gateway-tunnel"
SCRAPE_INTERVAL = 2.0
HEARTBEAT_TIMEOUT = 3.0


@dataclass
class Site:
    name: str  # a, b
    index: int  # 1, 2: LAN 10.201.<index>.0/24, WAN address 10.200.0.<index + 1>
    nodes: dict[str, str] = field(default_factory=dict)  # node name -> LAN address

    @property
    def pool(self) -> str:
        return f"site-{self.name}"

    @property
    def namespace(self) -> str:
        return f"rv-{self.name}-gw"

    @property
    def agents(self) -> list[str]:
        return [f"agent-{self.name}-{i}" for i in (1, 2)]


SITES = [
    Site("a", 1, {"gpu-a-1": "10.201.1.11", "gpu-a-2": "10.201.1.12"}),
    Site("b", 2, {"gpu-b-1": "10.201.2.11", "gpu-b-2": "10.201.2.12"}),
]
NODE_EXPORTER_ON_EVERY_NODE = True  # as a DaemonSet would run it
CLOUD_POOL = "cloud-1"
CLOUD_NODES = {"cloud-gpu-1": "10.200.0.21"}  # node -> address on the cloud network (namespace rv-c-n1)


@dataclass
class Process:
    name: str
    namespace: str
    argv: list[str]
    log: Path
    proc: asyncio.subprocess.Process | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Testbed:
    __test__ = False  # not a pytest test class

    def __init__(self, workdir: Path | None = None, replicas: int = 1, scrape_interval: float = SCRAPE_INTERVAL
                 ) -> None:
        if not 1 <= replicas <= len(REPLICA_IPS):
            raise TestbedError(f"replicas: 1 to {len(REPLICA_IPS)}")
        self.replicas = replicas
        self.scrape_interval = scrape_interval
        self.own_workdir = workdir is None  # a folder we made is ours to remove after a clean run
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="raven-testbed-"))
        self.certs = self.workdir / "pki"
        self.hosts_dir = self.workdir / "hosts"
        self.processes: dict[str, Process] = {}
        # The front end's bearer token: Prometheus reads it from this file (credentials_file).
        self.token = secrets.token_hex(16)
        self.token_file = self.workdir / "front-token"
        self.sites = [Site(s.name, s.index, dict(s.nodes)) for s in SITES]

    # ------------------------------------------------------------ topology

    @staticmethod
    async def topology(*args: str) -> None:
        if os.geteuid() != 0:
            raise TestbedError("the testbed needs root (network namespaces): run it as root or with sudo")
        proc = await asyncio.create_subprocess_exec(
            "bash", str(TOPOLOGY), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise TestbedError(f"topology.sh {' '.join(args)} failed: {out.decode(errors='replace').strip()}")

    # ------------------------------------------------------------ files

    def _write(self, name: str, tree: dict[str, Any]) -> Path:
        path = self.workdir / name
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        return path

    def make_files(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts_dir.mkdir(exist_ok=True)
        pki.create_ca(self.certs, common_name="Raven testbed CA")
        pki.issue(self.certs, self.certs, "gateway", "raven-gateway", dns_names=["raven-gateway"],
                  ip_addresses=[CLOUD_IP], days=2)
        for site in self.sites:
            for agent in site.agents:
                pki.issue(self.certs, self.certs, "agent", agent, pools=[site.pool], days=2)
        self.token_file.write_text(self.token + "\n")
        self.token_file.chmod(0o600)
        if self.replicas == 1:
            self.write_gateway_config()
        else:
            for replica in range(1, self.replicas + 1):
                self.write_replica_config(replica)
            # The tunnel's headless Service: one name, every replica's address (dnsmasq serves it).
            lines = [f"{ip} {TUNNEL_NAME}\n" for ip in REPLICA_IPS[:self.replicas]]
            (self.hosts_dir / TUNNEL_NAME).write_text("".join(lines))
        for site in self.sites:
            for i, agent in enumerate(site.agents):
                self.write_agent_config(site, agent, 10266 + i)
        bearer = {"type": "Bearer", "credentials_file": str(self.token_file)}

        ops = "127.0.0.1" if self.replicas == 1 else CLOUD_IP  # replicas: through the Service

        def sd(port: int) -> list[dict[str, Any]]:  # the inventory endpoint needs the token too
            # Grouped, as the shipped scrape configs ask (deploy/prometheus/scrape-config.yaml).
            return [{"url": f"http://{ops}:10265/sd?port={port}&group=pool", "refresh_interval": "1s",
                     "authorization": bearer}]

        def keep(*reaches: str) -> list[dict[str, Any]]:  # one job per way of reaching a node
            rules = [{"source_labels": ["__meta_raven_reach"], "regex": "|".join(reaches), "action": "keep"}]
            return rules + ([shipped_node_rule()] if "tunnel" in reaches else [])

        if self.replicas > 1:
            interval = f"{self.scrape_interval:g}s"
            self._write("prometheus.yml", {
                "global": {"scrape_interval": interval, "scrape_timeout": interval,
                           "evaluation_interval": interval},
                "scrape_configs": [
                    {"job_name": "edge-dcgm", "http_sd_configs": sd(9400), "authorization": bearer,
                     "relabel_configs": keep("tunnel")},
                    {"job_name": "edge-node", "http_sd_configs": sd(9100),
                     "proxy_url": f"http://prometheus:{self.token}@{CLOUD_IP}:9400", "relabel_configs": keep("tunnel")},
                    {"job_name": "direct-dcgm", "http_sd_configs": sd(9400),
                     "relabel_configs": keep("direct", "layer3")},
                    {"job_name": "direct-node", "http_sd_configs": sd(9100),
                     "relabel_configs": keep("direct", "layer3")},
                    {"job_name": "raven-gateway",
                     "static_configs": [{"targets": [f"{ip}:10265" for ip in REPLICA_IPS[:self.replicas]]}]},
                    {"job_name": "prometheus", "static_configs": [{"targets": ["127.0.0.1:9090"]}]},
                ],
            })
            return

        self._write("prometheus.yml", {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL:g}s", "scrape_timeout": "1500ms",
                       "evaluation_interval": f"{SCRAPE_INTERVAL:g}s"},
            # Backfill (docs/backfill.md): the shipped configuration's out-of-order window, so what an agent kept
            # through an outage is taken with its own timestamps.
            "storage": shipped_storage(),
            "scrape_configs": [
                # Host-header (DNS) mode: names resolve to the gateway; the token in Authorization.
                {"job_name": "edge-dcgm", "http_sd_configs": sd(9400), "authorization": bearer,
                 "relabel_configs": keep("tunnel")},
                # Proxy mode: the token as the password of proxy_url's user info (Proxy-Authorization).
                {"job_name": "edge-node", "http_sd_configs": sd(9100),
                 "proxy_url": f"http://prometheus:{self.token}@{CLOUD_IP}:9400", "relabel_configs": keep("tunnel")},
                # The on-cloud pool: the same discovery, scraped directly (no proxy, no token for the node).
                {"job_name": "direct-dcgm", "http_sd_configs": sd(9400), "relabel_configs": keep("direct", "layer3")},
                {"job_name": "direct-node", "http_sd_configs": sd(9100), "relabel_configs": keep("direct", "layer3")},
                # The same targets without credentials, in both modes: refused with 401 and 407.
                {"job_name": "noauth-dcgm", "http_sd_configs": sd(9400), "relabel_configs": keep("tunnel")},
                {"job_name": "noauth-proxy", "http_sd_configs": sd(9100), "proxy_url": f"http://{CLOUD_IP}:9400",
                 "relabel_configs": keep("tunnel")},
                {"job_name": "raven-gateway", "static_configs": [{"targets": ["127.0.0.1:10265"]}]},
            ],
        })

    def tls(self, name: str) -> dict[str, str]:
        return {"cert": str(self.certs / f"{name}.pem"), "key": str(self.certs / f"{name}-key.pem"),
                "ca": str(self.certs / "ca.pem")}

    def write_gateway_config(self) -> Path:
        return self._write("gateway.yaml", {
            "replica_id": "cloud-1",
            "tunnel": {"listen": f"{CLOUD_IP}:10262"},
            "front": {"listen": f"{CLOUD_IP}:9400", "also_listen": [f"{CLOUD_IP}:9100"],
                      "allowed_ports": [9400, 9100], "request_timeout": 10,
                      "auth": {"token_files": [str(self.token_file)]}},
            "metrics_listen": "0.0.0.0:10265",
            "tls": self.tls("raven-gateway"),
            "limits": {"heartbeat_interval": 1, "heartbeat_timeout": HEARTBEAT_TIMEOUT},
            "hosts": {"file": str(self.hosts_dir / "tunnel-nodes"), "service_addresses": [CLOUD_IP],
                      "debounce": 0.2, "direct": "internal-ip"},
            "pools": self._cloud_pools(),
            # Backfill into this bed's Prometheus (its receiver is on: start_prometheus), jobs as configured above.
            # The bed's jobs keep the discovery's port label (its relabelling is keep() above): so does backfill.
            "backfill": {"receivers": [{"url": "http://127.0.0.1:9090/api/v1/write"}],
                         "jobs": {9400: "edge-dcgm", 9100: "edge-node"}, "poll_interval": 2,
                         "target_labels": ["job", "instance", "node", "pool", "port"]},
            "ready_settle": 0.5,
            # The agents' reconnect bound: their backoff_max (1 s here) and a refused dial, with a margin.
            "ready_max_wait": 5,
            "drain_linger": 0.5,
            "drain_grace": 5,
        })

    @staticmethod
    def _cloud_pools() -> dict[str, Any]:
        """The on-cloud pool as the gateway's configuration names it: reached directly, its nodes' addresses."""
        return {CLOUD_POOL: {"reach": "direct", "nodes": [{"name": n, "address": a} for n, a in CLOUD_NODES.items()]}}

    def write_replica_config(self, replica: int) -> Path:
        """Replica ``replica`` (1, 2) of the gateway behind the Service: its own address, ports as in a pod."""
        ip = REPLICA_IPS[replica - 1]
        tree: dict[str, Any] = {
            "replica_id": f"cloud-{replica}",
            "replicas": self.replicas,
            "tunnel": {"listen": f"{ip}:10262"},
            "front": {"listen": f"{ip}:9400", "also_listen": [f"{ip}:9100"],
                      "allowed_ports": [9400, 9100], "request_timeout": 10,
                      "auth": {"token_files": [str(self.token_file)]}},
            "metrics_listen": f"{ip}:10265",
            "tls": self.tls("raven-gateway"),
            "limits": {"heartbeat_interval": 1, "heartbeat_timeout": HEARTBEAT_TIMEOUT},
            "hosts": {"service_addresses": [CLOUD_IP], "debounce": 0.2, "direct": "internal-ip"},
            "pools": self._cloud_pools(),
            # The agents' reconnect bound: their backoff_max (1 s here) and a refused dial, with a margin.
            "ready_max_wait": 5,
            # Longer than the Service's probe period (0.5 s): the Service has taken the replica out by then.
            "drain_linger": 1.5,
            "drain_grace": 5,
        }
        if replica == 1:  # one writer of the hosts file that dnsmasq serves (in Kubernetes, the Lease holder)
            tree["hosts"]["file"] = str(self.hosts_dir / "tunnel-nodes")
        return self._write(f"gateway-{replica}.yaml", tree)

    def write_agent_config(self, site: Site, agent: str, metrics_port: int) -> Path:
        gateway: dict[str, Any] = {"url": f"wss://{CLOUD_IP}:10262/tunnel", "server_name": "raven-gateway"}
        if self.replicas > 1:  # every replica, through the name of the tunnel's headless Service
            gateway.update(url=f"wss://{TUNNEL_NAME}:10262/tunnel", resolver=f"{CLOUD_IP}:53")
        return self._write(f"{agent}.yaml", {
            "pool": site.pool,
            "gateway": {**gateway, "backoff_initial": 0.2, "backoff_max": 1.0},
            "nodes": [{"name": n, "address": a} for n, a in sorted(site.nodes.items())],
            "allowed_ports": [9400, 9100],
            "metrics_listen": f"127.0.0.1:{metrics_port}",
            "tls": self.tls(agent),
            "drain_grace": 5,
        })

    # ------------------------------------------------------------ processes

    async def spawn(self, name: str, namespace: str, argv: list[str]) -> Process:
        log = self.workdir / f"{name}.log"
        p = Process(name, namespace, argv, log)
        with log.open("ab") as out:
            p.proc = await asyncio.create_subprocess_exec(
                "ip", "netns", "exec", namespace, *argv,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, cwd=ROOT,
            )
        self.processes[name] = p
        return p

    async def stop(self, name: str, sig: int = signal.SIGTERM, grace: float = 10.0) -> int | None:
        p = self.processes.get(name)
        if p is None or p.proc is None:
            return None
        return await stop_process(p.proc, sig, grace)

    def signal(self, name: str, sig: int) -> None:
        p = self.processes[name]
        if p.proc is not None and p.running:
            p.proc.send_signal(sig)

    def raven(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "raven.cli", *args]

    async def start_gateway(self, replica: int = 0) -> None:
        """The gateway (``replica`` 0), or replica 1 or 2 of those behind the Service."""
        name = "gateway" if replica == 0 else f"gateway-{replica}"
        await self.spawn(name, "rv-cloud", self.raven("gateway", "--config", str(self.workdir / f"{name}.yaml")))

    async def start_service(self) -> None:
        """The Service in front of the replicas: its ports at 10.200.0.1, the ops port also for this host."""
        backends = [a for ip in REPLICA_IPS[:self.replicas] for a in ("--backend", ip)]
        lb = [sys.executable, "-m", "tests.support.servicelb", *backends, "--probe-port", "10265"]
        await self.spawn("service", "rv-cloud", [*lb, "--address", CLOUD_IP, "--port", "9400", "--port", "9100",
                                                 "--port", "10265", "--status", f"{OBSERVER_IP}:10270"])
        await self.spawn("service-observer", "rv-cloud", [*lb, "--address", OBSERVER_IP, "--port", "10265"])

    async def start_agent(self, site: Site, agent: str) -> None:
        await self.spawn(agent, site.namespace, self.raven("agent", "--config", str(self.workdir / f"{agent}.yaml")))

    async def start_exporters(self, node: str, address: str, ns: str) -> None:
        await self.spawn(f"dcgm-{node}", ns, [sys.executable, "-m", "raven.demo.simexporter", "--no-gzip",
                                              "--node", f"{node}={address}:9400"])
        if NODE_EXPORTER_ON_EVERY_NODE:
            exe = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
            if exe is None:
                raise TestbedError("prometheus-node-exporter is not installed (Debian package)")
            await self.spawn(f"node-exporter-{node}", ns, [exe, f"--web.listen-address={address}:9100"])

    async def start(self) -> None:
        await self.topology("up")
        self.make_files()
        for site in self.sites:
            for node, address in site.nodes.items():
                await self.start_exporters(node, address, f"rv-{site.name}-n{node[-1]}")
        for node, address in CLOUD_NODES.items():
            await self.start_exporters(node, address, f"rv-c-n{node[-1]}")
        dnsmasq = shutil.which("dnsmasq", path="/usr/sbin:/usr/bin:/sbin:/bin")
        prometheus = shutil.which("prometheus")
        if dnsmasq is None or prometheus is None:
            raise TestbedError("dnsmasq (dnsmasq-base) and prometheus (Debian packages) are required")
        # With replicas, the edge sites ask it for the tunnel's headless name too.
        listen = "127.0.0.1" if self.replicas == 1 else f"127.0.0.1,{CLOUD_IP}"
        await self.spawn("dnsmasq", "rv-cloud", [
            dnsmasq, "--keep-in-foreground", f"--listen-address={listen}", "--bind-interfaces", "--no-resolv",
            "--no-hosts", f"--hostsdir={self.hosts_dir}", "--user=root", "--group=root", "--pid-file=",
            "--cache-size=0", "--log-facility=-",
        ])
        if self.replicas == 1:
            await self.start_gateway()
        else:
            for replica in range(1, self.replicas + 1):
                await self.start_gateway(replica)
            await self.start_service()
        for site in self.sites:
            for agent in site.agents:
                await self.start_agent(site, agent)
        await self.start_prometheus(prometheus)

    async def close(self) -> None:
        names = list(self.processes)
        await asyncio.gather(*(self.stop(n, grace=5) for n in names), return_exceptions=True)
        with contextlib.suppress(TestbedError):
            await self.topology("down")

    # ------------------------------------------------------------ uplinks (issue 20: slow, lossy, cut)

    async def shape_uplink(self, site: Site, rtt_ms: int, loss_pct: float, rate_kbit: int) -> None:
        """Both directions of ``site``'s uplink: half of ``rtt_ms`` each way, ``loss_pct`` % lost each way (100:
        cut), ``rate_kbit``. The delay is held by tests/support/linkdelay.py in the site's gateway namespace."""
        name = f"linkdelay-{site.name}"
        delay = f"{rtt_ms / 2:g}"
        p = self.processes.get(name)
        if p is not None and (not p.running or p.argv[-1] != delay):
            await self.stop(name, grace=5)
            p = None
        if p is None and rtt_ms > 0:
            await self.spawn(name, site.namespace, [sys.executable, "-m", "tests.support.linkdelay", "--queue", "0",
                                                    "--delay-ms", delay])
        await self.topology("shape", site.name, str(rtt_ms), f"{loss_pct:g}", str(rate_kbit))

    async def unshape_uplink(self, site: Site) -> None:
        await self.topology("shape", site.name, "off")
        await self.stop(f"linkdelay-{site.name}", grace=5)

    # ------------------------------------------------------------ observing (through Prometheus)

    async def get_json(self, url: str, params: dict[str, str] | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if url.startswith(GATEWAY_OPS) else {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(url, params=params, headers=headers) as resp:
                return json.loads(await resp.text())

    async def query(self, promql: str) -> dict[str, float]:
        """Instant query; result keyed by the node label (or instance)."""
        data = await self.get_json(PROMETHEUS + "/api/v1/query", {"query": promql})
        out = {}
        for r in data["data"]["result"]:
            key = r["metric"].get("node") or r["metric"].get("instance", "")
            if r["metric"].get("port"):
                key = f"{key}:{r['metric']['port']}"
            out[key] = float(r["value"][1])
        return out

    async def endpoints(self) -> dict[str, bool]:
        """Replicas mode: which replicas the Service sends new connections to (its ready endpoints)."""
        data = await self.get_json(SERVICE_STATUS)
        return {ip: bool(ok) for ip, ok in data["ready"].items()}

    async def agent_ready(self, site: Site, agent: str) -> bool:
        """The agent's /readyz (it listens on loopback inside its site's namespace)."""
        port = 10266 + site.agents.index(agent)
        probe = ("import sys, urllib.request\n"
                 "try:\n"
                 f"    sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:{port}/readyz', timeout=2).status == 200"
                 " else 1)\n"
                 "except Exception:\n"
                 "    sys.exit(1)\n")
        proc = await asyncio.create_subprocess_exec("ip", "netns", "exec", site.namespace, sys.executable, "-c", probe,
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        return await proc.wait() == 0

    def edge_targets(self) -> list[str]:
        return sorted(f"{n}:{port}" for s in self.sites for n in s.nodes for port in (9400, 9100))

    async def start_prometheus(self, prometheus: str) -> None:
        """Debian's Prometheus in the cloud namespace, with this bed's prometheus.yml and its own storage."""
        await self.spawn("prometheus", "rv-cloud", [
            prometheus, f"--config.file={self.workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.workdir / 'prometheus-data'}", "--web.listen-address=0.0.0.0:9090",
            "--web.enable-remote-write-receiver",
            "--log.level=warn",
        ])

    @staticmethod
    def direct_targets() -> list[str]:
        return sorted(f"{n}:{port}" for n in CLOUD_NODES for port in (9400, 9100))

    async def wait_all_up(self, timeout: float = 60.0) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            try:
                up = await self.query('up{job=~"edge-.*|direct-.*"}')
                if sorted(up) == sorted(self.edge_targets() + self.direct_targets()) and all(
                        v == 1 for v in up.values()):
                    return loop.time() - start
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                pass
            if loop.time() - start > timeout:
                raise TestbedError(f"not every edge target up within {timeout:.0f}s: {await self._safe_up()}")
            await asyncio.sleep(0.5)

    async def _safe_up(self) -> object:
        try:
            return await self.query('up{job=~"edge-.*|direct-.*"}')
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            return repr(exc)


async def _run(args: argparse.Namespace) -> int:
    bed = Testbed(Path(args.workdir) if args.workdir else None, replicas=args.replicas)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = 1
    try:
        print(f"testbed: building namespaces and starting processes (logs in {bed.workdir})", flush=True)
        await bed.start()
        took = await bed.wait_all_up()
        print(f"testbed: every edge target is up in Prometheus after {took:.1f}s")
        print(f"  Prometheus targets page:  {PROMETHEUS}/targets")
        print(f"  a query:                   {PROMETHEUS}/graph?g0.expr=DCGM_FI_DEV_GPU_UTIL")
        print(f"  the gateway's discovery:   curl {GATEWAY_OPS}/sd ;  hosts file: {bed.hosts_dir / 'tunnel-nodes'}")
        print("  try: sudo deploy/testbed/topology.sh uplink b down   (site b's targets go down, then 'up')")
        if args.command == "run":
            print("Press Ctrl-C to tear everything down.")
            await stop.wait()
        code = 0
    except TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
    finally:
        await bed.close()
        if code == 0 and bed.own_workdir:
            shutil.rmtree(bed.workdir, ignore_errors=True)
            print("testbed: torn down")
        else:
            print(f"testbed: torn down; logs kept in {bed.workdir}")
    return code


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.testbed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "check"],
                        help="run: stay up until Ctrl-C; check: come up, wait for every target, tear down")
    parser.add_argument("--replicas", type=int, default=1, choices=[1, 2],
                        help="2: two gateway replicas behind a Service (tests/support/servicelb.py)")
    parser.add_argument("--workdir", help="folder for certificates, configs and logs (default: a new temp folder)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("testbed: the testbed needs root (network namespaces): run it as root or with sudo", file=sys.stderr)
        return 1
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
