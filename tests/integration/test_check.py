"""``raven check`` against the fake API server (tests/support/fakekube.py), seeded with what ``raven install``
rendered (the real command's objects, Secrets and certificates included), and against per-replica ops listeners
serving ``/status`` documents of the gateway's shape behind its bearer token.

The healthy cluster passes every check (exit 0); then each fault the issue lists is made, one at a time, and the
check is run again as a process: the fault's line turns ✘ with its fix, and the exit status is 1.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from raven import pki, version
from raven.dns.hosts import render as render_hosts
from tests.support.dnsmasq import Dnsmasq
from tests.support.fakekube import FakeKube
from tests.support.paths import ROOT
from tests.support.procs import run_to_end
from tests.support.promtargets import PromTargets

RAVEN = [sys.executable, "-m", "raven.cli"]
POOL = "apps.openyurt.io/nodepool"
ADDRESS = "10.96.0.100"
ANSWERS = f"""\
service_address: {ADDRESS}
certificates: raven
monitoring: none
pools:
  - name: pool-a
  - name: pool-b
  - name: dc-1
    reach: direct
"""
REPLICAS = ("raven-gateway-a1b2c", "raven-gateway-d3e4f")
EDGE_NODES = ("edge-a-1", "edge-b-1")
DEFAULT_COREFILE = """.:53 {
    errors
    health {
       lameduck 5s
    }
    ready
    kubernetes cluster.local in-addr.arpa ip6.arpa {
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }
    prometheus :9153
    forward . /etc/resolv.conf {
       max_concurrent 1000
    }
    cache 30
    loop
    reload
    loadbalance
}
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One real ``raven install --with-secrets`` for the whole module."""
    work = tmp_path_factory.mktemp("install")
    (work / "answers.yaml").write_text(ANSWERS)
    proc = subprocess.run([*RAVEN, "install", "-f", "answers.yaml", "--with-secrets"], cwd=work, capture_output=True,
                          text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    return work / "raven-secrets", [d for d in yaml.safe_load_all(proc.stdout) if d]


def corefile_with_snippet() -> str:
    snippet = (ROOT / "deploy" / "coredns" / "Corefile.snippet").read_text()
    head, sep, tail = DEFAULT_COREFILE.partition("    kubernetes cluster.local")
    return head + snippet + sep + tail


def coredns_deployment() -> dict[str, Any]:
    """kubeadm's coredns Deployment (the parts checked) with deploy/coredns/coredns-patch.yaml applied."""
    patch = yaml.safe_load((ROOT / "deploy" / "coredns" / "coredns-patch.yaml").read_text())
    patched = patch["spec"]["template"]["spec"]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "coredns", "namespace": "kube-system"},
        "spec": {"template": {"spec": {
            "containers": [{"name": "coredns", "volumeMounts": [
                {"name": "config-volume", "mountPath": "/etc/coredns", "readOnly": True},
                *patched["containers"][0]["volumeMounts"]]}],
            "volumes": [{"name": "config-volume", "configMap": {"name": "coredns"}}, *patched["volumes"]]}}},
    }


@dataclass
class Replica:
    """One gateway replica's ops listener: /status behind the front end's bearer token (its ``time`` this
    machine's clock plus ``skew``), and /metrics with the process's descriptors."""

    status: dict[str, Any]
    token: str
    url: str = ""
    skew: float = 0.0
    fds: tuple[int, int] = (40, 1048576)  # process_open_fds, process_max_fds

    async def handle(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.Response(status=401)
        return web.json_response({**self.status, "time": time.time() + self.skew})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=f"# TYPE process_open_fds gauge\nprocess_open_fds {self.fds[0]}\n"
                            f"# TYPE process_max_fds gauge\nprocess_max_fds {self.fds[1]}\n")


def status_of(replica: str, pools: dict[str, str]) -> dict[str, Any]:
    """A /status as gateway/status.py builds it (the keys raven check reads), every pool with two agents."""
    return {
        "replica": replica, "replicas": 1, "version": version.RELEASE, "ready": True, "draining": False,
        "pools": [{"pool": pool, "reach": reach, "nodes": 1, "agents": [] if reach == "direct" else [
            {"agent": f"agent-{pool}-1", "session": f"{pool}{i}", "draining": False, "version": version.RELEASE,
             "protocol": 3, "clock_offset_seconds": 0.0} for i in range(2)]} for pool, reach in sorted(pools.items())],
        "nodes": [],
    }


@dataclass
class Cluster:
    fake: FakeKube
    replicas: list[Replica]
    kubeconfig: Path
    token_file: Path
    secrets: Path
    dns: Dnsmasq | None = None  # the cluster DNS: dnsmasq reading the published hosts file, as CoreDNS would
    prometheus: PromTargets | None = None


async def start_dns(fake: FakeKube, tmp_path: Path) -> Dnsmasq:
    hosts = tmp_path / "tunnel-nodes"
    hosts.write_text(fake.configmaps[("kube-system", "edge-tunnel-nodes")]["data"]["tunnel-nodes"])
    dns = Dnsmasq(hosts)
    await dns.start()
    return dns


def seed(fake: FakeKube, docs: list[dict[str, Any]], edge: dict[str, str] | None = None,
         direct: dict[str, str] | None = None, hosts: str | None = None) -> None:
    """The rendered objects, as a healthy cluster has them: ``edge`` (node -> tunnel pool, default EDGE_NODES in
    pool-a and pool-b) and ``direct`` (node -> direct pool) Nodes, and the hosts file (default: the edge nodes at
    ADDRESS)."""
    edge = edge if edge is not None else {n: f"pool-{n[5]}" for n in EDGE_NODES}
    direct = direct if direct is not None else {"dc-1-gpu": "dc-1"}
    for doc in docs:
        doc = copy.deepcopy(doc)
        if doc["kind"] == "ConfigMap":
            fake.configmaps[(doc["metadata"]["namespace"], doc["metadata"]["name"])] = doc
            continue
        if doc["kind"] == "DaemonSet" and doc["metadata"]["name"] == "raven-gateway":
            doc["status"] = {"desiredNumberScheduled": 2, "numberReady": 2}
        if doc["kind"] == "Deployment":
            doc["status"] = {"replicas": 2, "readyReplicas": 2}
        if doc["kind"] in ("DaemonSet", "Deployment", "Service", "Secret"):
            fake.objects.put(doc)
    for name in REPLICAS:
        fake.objects.put({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": "kube-system", "labels": {"app.kubernetes.io/name": "raven-gateway"}},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}})
    fake.objects.put(coredns_deployment())
    fake.configmaps[("kube-system", "coredns")] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "coredns", "namespace": "kube-system"}, "data": {"Corefile": corefile_with_snippet()}}
    fake.add_node("cloud-1", {})
    for node, pool in edge.items():
        fake.add_node(node, {POOL: pool, "openyurt.io/is-edge-worker": "true"})
    for node, pool in direct.items():
        fake.add_node(node, {POOL: pool})
    fake.configmaps[("kube-system", "edge-tunnel-nodes")] = {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "edge-tunnel-nodes", "namespace": "kube-system"},
        # A direct pool's node at its own address, as the gateway lists it with hosts.direct: internal-ip.
        "data": {"tunnel-nodes": hosts if hosts is not None else render_hosts(sorted(edge), [ADDRESS])
                 + "".join(f"10.0.9.{i}\t{node}\n" for i, node in enumerate(sorted(direct), 1))}}


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PromTargets]:
    """A real Prometheus scraping job edge-dcgm with a target per edge node of the seeded cluster."""
    targets = PromTargets(tmp_path_factory.mktemp("prometheus"), list(EDGE_NODES))
    try:
        targets.start()
        yield targets
    finally:
        targets.close()


@pytest.fixture
async def cluster(installed: tuple[Path, list[dict[str, Any]]], prometheus: PromTargets, tmp_path: Path
                  ) -> AsyncIterator[Cluster]:
    secrets, docs = installed
    if prometheus.down:  # an earlier test's fault: every target up again first
        prometheus.down.clear()
        await asyncio.to_thread(prometheus.wait, lambda up: set(up.values()) == {1.0})
    fake = FakeKube()
    await fake.start()
    token = (secrets / "front-token").read_text().strip()
    replicas = [Replica(status_of(r, {"pool-a": "tunnel", "pool-b": "tunnel", "dc-1": "direct"}), token)
                for r in REPLICAS]
    runners = []
    dns = None
    try:
        seed(fake, docs)
        dns = await start_dns(fake, tmp_path)
        for replica in replicas:
            app = web.Application()
            app.router.add_get("/status", replica.handle)
            app.router.add_get("/metrics", replica.metrics)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            replica.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield Cluster(fake, replicas, fake.write_kubeconfig(tmp_path / "kubeconfig"), secrets / "front-token",
                      secrets, dns, prometheus)
    finally:
        for runner in runners:
            await runner.cleanup()
        if dns is not None:
            await dns.close()
        await fake.close()


async def check(c: Cluster, *extra: str, token: bool = False) -> tuple[int, dict[str, Any], str]:
    """Run ``raven check -o json`` and ``raven check`` as processes; the exit status, the JSON and the text."""
    args = [*RAVEN, "check", "--kubeconfig", str(c.kubeconfig), "--timeout", "5", *extra]
    for replica in c.replicas:
        args += ["--gateway", replica.url]
    if token:
        args += ["--token-file", str(c.token_file)]
    if c.dns is not None:
        args += ["--dns-server", c.dns.server]
    if c.prometheus is not None and "--prometheus" not in extra:
        args += ["--prometheus", c.prometheus.url]
    async def one(fmt: str) -> tuple[int, str]:
        code, out, err = await run_to_end(*args, "-o", fmt)
        assert b"Traceback" not in err, err.decode()
        return code, out.decode()

    # Both forms at once (they read the same cluster, which no check changes): half the wall time.
    (code, text_json), (code_text, text) = await asyncio.gather(one("json"), one("text"))
    assert code == code_text
    return int(code or 0), json.loads(text_json), text


def failures(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["check"]: c for c in doc["checks"] if not c["ok"]}


async def test_healthy_cluster_passes_every_check(cluster: Cluster) -> None:
    code, doc, text = await check(cluster)  # the token from Secret raven-gateway-front-token
    assert failures(doc) == {}, text
    assert code == 0 and doc["ok"]
    names = [c["check"] for c in doc["checks"]]
    assert names == ["gateway-pods", "service-address", "coredns-mount", "coredns-corefile", "dns-sample",
                     "node-pools", "ops-api",
                     "agents pool-a", "agents pool-b", "cert raven-agent-tls-pool-a", "cert raven-agent-tls-pool-b",
                     "cert raven-gateway-tls", "release-skew", "clock-skew", "prometheus", "descriptors"]
    assert "✔ gateway-pods" in text and "✘" not in text and "16 of 16 checks passed" in text
    rows = {c["check"]: c["detail"] for c in doc["checks"]}
    assert "up is 1 for edge-a-1, edge-b-1" in rows["prometheus"] and "edge-dcgm 2 targets" in rows["prometheus"]
    # 2 nodes x 1 target x 2 Prometheus replicas over 2 gateway replicas with one away, 4 sessions, 2048 reserve
    assert "raven-gateway-a1b2c 40/1048576 open, needs 2056" in rows["descriptors"], rows["descriptors"]


def _drop_corefile_block(c: Cluster) -> None:
    c.fake.configmaps[("kube-system", "coredns")]["data"]["Corefile"] = DEFAULT_COREFILE


def _wrong_service_address(c: Cluster) -> None:
    svc = c.fake.objects.items[("services", "kube-system", "raven-gateway")]
    svc["spec"]["clusterIP"] = "10.96.0.222"


def _names_resolve_elsewhere(c: Cluster) -> None:
    assert c.dns is not None
    c.dns.hosts_file.write_text(render_hosts(["edge-a-1", "edge-b-1"], ["10.96.0.7"]))
    c.dns.reload()


def _gateway_pod_not_ready(c: Cluster) -> None:
    pod = c.fake.objects.items[("pods", "kube-system", REPLICAS[1])]
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    c.fake.objects.items[("daemonsets", "kube-system", "raven-gateway")]["status"]["numberReady"] = 1


def _coredns_without_mount(c: Cluster) -> None:
    dep = c.fake.objects.items[("deployments", "kube-system", "coredns")]
    spec = dep["spec"]["template"]["spec"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] == "config-volume"]
    spec["containers"][0]["volumeMounts"] = spec["containers"][0]["volumeMounts"][:1]


def _node_in_unknown_pool(c: Cluster) -> None:
    c.fake.add_node("edge-z-1", {POOL: "pool-z", "openyurt.io/is-edge-worker": "true"})


def _agents_not_ready(c: Cluster) -> None:
    c.fake.objects.items[("deployments", "kube-system", "raven-agent-pool-a")]["status"]["readyReplicas"] = 0


def _unlabelled_node(c: Cluster) -> None:
    c.fake.add_node("edge-x-9", {"openyurt.io/is-edge-worker": "true"})


def _pool_without_agent(c: Cluster) -> None:
    c.fake.objects.remove("Deployment", "kube-system", "raven-agent-pool-b")


def _no_session_on_one_replica(c: Cluster) -> None:
    pool_b = next(p for p in c.replicas[1].status["pools"] if p["pool"] == "pool-b")
    pool_b["agents"] = []


def _expiring_certificate(c: Cluster) -> None:
    work = c.secrets.parent / "short"
    work.mkdir(exist_ok=True)
    for name in (pki.CA_CERT_FILE, pki.CA_KEY_FILE):
        (work / name).write_bytes((c.secrets / name).read_bytes())
    cert, _ = pki.issue(work, work, "agent", "agent-pool-a", pools=["pool-a"], days=5)
    secret = c.fake.objects.items[("secrets", "kube-system", "raven-agent-tls-pool-a")]
    secret["data"]["tls.crt"] = base64.b64encode(cert.read_bytes()).decode()


def _old_agent(c: Cluster) -> None:
    for replica in c.replicas:  # gateways upgraded to 0.5.0; pool-a's agents left on 0.2.0 (N-3)
        replica.status["version"] = "0.5.0"
        for pool in replica.status["pools"]:
            for agent in pool["agents"]:
                agent["version"] = "0.2.0" if pool["pool"] == "pool-a" else "0.5.0"


def _skewed_replica(c: Cluster) -> None:
    c.replicas[1].skew = 120.0


def _skewed_agent(c: Cluster) -> None:
    for replica in c.replicas:
        pool_a = next(p for p in replica.status["pools"] if p["pool"] == "pool-a")
        pool_a["agents"][0]["clock_offset_seconds"] = -45.0


def _node_down_in_prometheus(c: Cluster) -> None:
    assert c.prometheus is not None
    c.prometheus.down.add("edge-b-1")
    c.prometheus.wait(lambda up: up.get("edge-b-1") == 0)


def _low_descriptor_limit(c: Cluster) -> None:
    c.replicas[0].fds = (40, 1024)


FAULTS: list[tuple[str, Callable[[Cluster], None], str, str, str]] = [
    ("missing Corefile block", _drop_corefile_block, "coredns-corefile", "/etc/edge/tunnel-nodes",
     "deploy/coredns/Corefile.snippet"),
    ("wrong Service address", _wrong_service_address, "service-address", "10.96.0.222",
     "raven install --service-address 10.96.0.222"),
    ("names resolve elsewhere", _names_resolve_elsewhere, "dns-sample", "edge-a-1: 10.96.0.7",
     "CoreDNS does not serve the hosts file"),
    ("unlabelled Node", _unlabelled_node, "node-pools", "edge-x-9",
     "kubectl label node edge-x-9 apps.openyurt.io/nodepool=POOL"),
    ("gateway Pod not ready", _gateway_pod_not_ready, "gateway-pods", f"not ready: {REPLICAS[1]}",
     f"kubectl -n kube-system describe pod {REPLICAS[1]}"),
    ("CoreDNS without the mount", _coredns_without_mount, "coredns-mount", "does not mount ConfigMap edge-tunnel-nodes",
     "--patch-file deploy/coredns/coredns-patch.yaml"),
    ("Node in an unknown pool", _node_in_unknown_pool, "node-pools", "pool pool-z (nodes edge-z-1) is not configured",
     "raven install ... --pool pool-z"),
    ("agents not ready", _agents_not_ready, "agents pool-a", "no ready agent in raven-agent-pool-a",
     "kubectl -n kube-system logs deploy/raven-agent-pool-a"),
    ("pool with no agent", _pool_without_agent, "agents pool-b", "no agent Deployment",
     "raven install ... --pool pool-b"),
    ("no session to a replica", _no_session_on_one_replica, "agents pool-b", REPLICAS[1],
     "kubectl -n kube-system logs deploy/raven-agent-pool-b"),
    ("expiring certificate", _expiring_certificate, "cert raven-agent-tls-pool-a", "days (less than 14)",
     "describe certificate"),
    ("old agent", _old_agent, "release-skew", "pool-a (0.2.0)", "raven install --image REPOSITORY:0.5.0"),
    ("skewed gateway clock", _skewed_replica, "clock-skew",
     f"gateway replica {REPLICAS[1]} is 1", "timedatectl set-ntp true"),  # 120 s ahead, to a tenth
    ("skewed agent clock", _skewed_agent, "clock-skew", "agent agent-pool-a-1 (pool pool-a, via replica", "behind"),
    ("node down in Prometheus", _node_down_in_prometheus, "prometheus", "up is 0 for edge-b-1",
     "raven status --gateway http://GATEWAY:10265 --token-file FILE --node edge-b-1"),
    ("low descriptor limit", _low_descriptor_limit, "descriptors",
     f"replica {REPLICAS[0]}: open-files limit 1024, needs 2056", "LimitNOFILE"),
]


ALSO = {"service-address": {"dns-sample"}}


@pytest.mark.parametrize(("make", "name", "detail", "fix"), [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
async def test_each_fault_is_reported_with_its_fix(cluster: Cluster, make: Callable[[Cluster], None], name: str,
                                                   detail: str, fix: str) -> None:
    make(cluster)
    code, doc, text = await check(cluster, token=True)
    bad = failures(doc)
    assert code == 1 and not doc["ok"]
    # This fault, and nothing else (a wrong Service address also means names resolve to an address it lacks).
    assert set(bad) == {name} | ALSO.get(name, set()), text
    assert detail in bad[name]["detail"] and (fix in bad[name]["fix"] or fix in bad[name]["detail"]), bad[name]
    assert f"✘ {name}" in text and "fix: " in text


async def test_unreachable_ops_and_wrong_token_say_what_to_do(cluster: Cluster, tmp_path: Path) -> None:
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token\n")
    code, doc, _ = await check(cluster, "--token-file", str(wrong))
    bad = failures(doc)
    assert code == 1 and "refused the token" in bad["ops-api"]["detail"]
    cluster.replicas[0].url = "http://127.0.0.1:9"  # nothing listens on the discard port
    code, doc, _ = await check(cluster, token=True)
    assert code == 1 and "cannot connect to http://127.0.0.1:9/status" in failures(doc)["ops-api"]["detail"]
    assert "port-forward" in failures(doc)["ops-api"]["fix"]


async def test_pre_install_checks(cluster: Cluster) -> None:
    code, doc, text = await check(cluster, "--pre", "--service-address", "10.96.0.50", "--certificates", "raven")
    assert code == 0, text
    assert [c["check"] for c in doc["checks"]] == ["api-version", "coredns", "service-address"]
    # A taken address, an old API server and no cert-manager: each named.
    cluster.fake.objects.put({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "other", "namespace": "x"},
                              "spec": {"clusterIP": "10.96.0.50"}})
    cluster.fake.objects.version = {"major": "1", "minor": "27", "gitVersion": "v1.27.3"}
    code, doc, _ = await check(cluster, "--pre", "--service-address", "10.96.0.50")
    bad = failures(doc)
    assert code == 1 and set(bad) == {"api-version", "cert-manager", "service-address"}
    assert "x/other" in bad["service-address"]["detail"] and "v1.27.3" in bad["api-version"]["detail"]
    cluster.fake.objects.remove("Deployment", "kube-system", "coredns")  # no CoreDNS: the proxy mode is the way
    code, doc, _ = await check(cluster, "--pre", "--service-address", "10.96.0.51", "--certificates", "raven")
    bad = failures(doc)
    assert code == 1 and set(bad) == {"api-version", "coredns"} and "proxy mode" in bad["coredns"]["fix"]
