"""``raven install``: the stream it prints is a valid, loadable, deterministic installation, and keeps secrets out.

Each test runs the real command (a process, with the virtualenv's kubectl) and checks its output with the same
validators as every shipped manifest (tests/support/schemas.py: kubernetes-validate, the Prometheus Operator's and
cert-manager's schemas), and the gateway's configuration as the pod would load it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from raven import pki
from raven.config import AgentConfig, GatewayConfig, build
from tests.support import schemas

RAVEN = [sys.executable, "-m", "raven.cli"]
LAYER3_ANSWERS = """\
service_address: 10.96.0.120
image: reg.example.com/raven@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
certificates: raven
monitoring: prometheus
layer3: true
pools:
  - name: pool-a
  - name: dc-1
    reach: direct
  - name: pool-c
    reach: layer3
    cidrs: [10.20.0.0/16]
    lan_address: 192.0.2.100/24
    node_selector: {example.com/zone: c}
"""
BASIC = ["--service-address", "10.96.0.100", "--pool", "pool-a", "--pool", "pool-b", "--pool", "dc-1=direct",
         "--image", "reg.example.com/raven/raven-tunnel:0.2.0"]


def run(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*RAVEN, "install", *args], cwd=cwd, capture_output=True, text=True, timeout=180,
                          check=False)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def env_of(workload: dict[str, Any]) -> dict[str, str]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    # What the kubelet fills in: the pod's name (fieldRef) and $(NODE_IP) (the node's address).
    return {e["name"]: e.get("value", "pod-0").replace("$(NODE_IP)", "10.0.0.5") for e in container.get("env", [])}


def assert_valid(docs: list[dict[str, Any]]) -> None:
    failures = [f"{d['kind']}/{d['metadata']['name']}: {'; '.join(errs)}"
                for d, errs in zip(docs, schemas.schema_errors(docs), strict=True) if errs]
    assert not failures, "\n".join(failures)


def test_basic_install_is_valid_complete_and_has_no_secret(tmp_path: Path) -> None:
    proc = run(BASIC, tmp_path)
    docs = docs_of(proc.stdout)
    assert_valid(docs)
    kinds = {d["kind"] for d in docs}
    assert "Secret" not in kinds
    assert {"DaemonSet", "Deployment", "Certificate", "Issuer", "ServiceMonitor", "PodMonitor", "ScrapeConfig",
            "PrometheusRule"} <= kinds
    # One agent Deployment per tunnel pool, none for the direct pool, each on its pool's nodes with its Secret.
    agents = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Deployment")
    assert agents == ["raven-agent-pool-a", "raven-agent-pool-b"]
    for pool in ("pool-a", "pool-b"):
        dep = one(docs, "Deployment", f"raven-agent-{pool}")
        spec = dep["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"apps.openyurt.io/nodepool": pool}
        assert env_of(dep)["RAVEN_POOL"] == pool
        assert spec["containers"][0]["image"] == "reg.example.com/raven/raven-tunnel:0.2.0"
        assert {"secretName": f"raven-agent-tls-{pool}", "defaultMode": 288} in [
            v.get("secret") for v in spec["volumes"]]
        cert = one(docs, "Certificate", f"raven-agent-{pool}")
        assert cert["spec"]["secretName"] == f"raven-agent-tls-{pool}"
        assert f"urn:raven:pool:{pool}" in cert["spec"]["uris"]
    gateway = one(docs, "DaemonSet", "raven-gateway")
    assert gateway["spec"]["template"]["spec"]["containers"][0]["image"] == "reg.example.com/raven/raven-tunnel:0.2.0"
    assert one(docs, "Service", "raven-gateway")["spec"]["clusterIP"] == "10.96.0.100"
    # The secret material went to files, and none of it to the output.
    token = (tmp_path / "raven-secrets" / "front-token").read_text().strip()
    ca_key = (tmp_path / "raven-secrets" / "ca-key.pem").read_text()
    assert len(token) == 64 and token not in proc.stdout and "PRIVATE KEY" not in proc.stdout
    assert ca_key.splitlines()[1] not in proc.stdout
    assert (tmp_path / "raven-secrets" / "front-token").stat().st_mode & 0o077 == 0
    assert "create secret generic raven-gateway-front-token" in proc.stderr
    assert token not in proc.stderr
    # raven check's own ServiceAccount, where the NetworkPolicy lets it reach the ops port: read-only, and of the
    # Secrets only those it checks, each pool's TLS Secret by name.
    assert one(docs, "ServiceAccount", "raven-check")["metadata"]["namespace"] == "monitoring"
    rules = one(docs, "Role", "raven-check")["rules"] + one(docs, "ClusterRole", "raven-check")["rules"]
    assert {v for r in rules for v in r["verbs"]} == {"get", "list"}
    (secret_rule,) = [r for r in rules if "secrets" in r["resources"]]
    assert secret_rule["verbs"] == ["get"] and secret_rule["resourceNames"] == [
        "raven-gateway-front-token", "raven-gateway-tls", "raven-agent-tls-pool-a", "raven-agent-tls-pool-b"]


@pytest.fixture(scope="module")
def layer3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """LAYER3_ANSWERS rendered once (without secrets) for the tests that read it: (its directory, the output)."""
    where = tmp_path_factory.mktemp("install-layer3")
    (where / "answers.yaml").write_text(LAYER3_ANSWERS)
    return where, run(["-f", "answers.yaml"], where).stdout


def test_gateway_and_agents_load_what_was_rendered(layer3: tuple[Path, str]) -> None:
    """The gateway's configuration, with the DaemonSet's environment, knows the pools' reach and the address."""
    tmp_path, rendered = layer3
    docs = docs_of(rendered)
    secrets_dir = tmp_path / "raven-secrets"
    tls = [f"tls.cert={secrets_dir / 'raven-gateway.pem'}", f"tls.key={secrets_dir / 'raven-gateway-key.pem'}",
           f"tls.ca={secrets_dir / 'ca.pem'}"]
    config = tmp_path / "gateway.yaml"
    config.write_text(one(docs, "ConfigMap", "raven-gateway-config")["data"]["gateway.yaml"])
    env = env_of(one(docs, "DaemonSet", "raven-gateway"))
    cfg = build(GatewayConfig, config, tls, environ=env)
    assert cfg.hosts.service_addresses == ["10.96.0.120"]
    assert {name: p.reach for name, p in cfg.pools.items()} == {"pool-a": "tunnel", "dc-1": "direct",
                                                                "pool-c": "layer3"}
    assert cfg.layer3.enabled and [str(c) for c in cfg.layer3.pools["pool-c"].cidrs] == ["10.20.0.0/16"]
    # The layer-3 pool's agents: the component's capabilities, the pool's own selector and certificate with its CIDR.
    agent = one(docs, "Deployment", "raven-agent-pool-c")
    assert agent["spec"]["template"]["spec"]["nodeSelector"] == {"example.com/zone": "c"}
    assert "NET_ADMIN" in agent["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
    identity = pki.load_identity(secrets_dir / "agent-pool-c.pem")
    assert list(identity.pools) == ["pool-c"] and [str(c) for c in identity.cidrs] == ["10.20.0.0/16"]
    agent_cfg = tmp_path / "agent.yaml"
    cm = next(d for d in docs
              if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("raven-agent-config-pool-c"))
    agent_cfg.write_text(cm["data"]["agent.yaml"])
    loaded = build(AgentConfig, agent_cfg, [f"tls.cert={secrets_dir / 'agent-pool-c.pem'}",
                                            f"tls.key={secrets_dir / 'agent-pool-c-key.pem'}",
                                            f"tls.ca={secrets_dir / 'ca.pem'}"], environ=env_of(agent))
    assert loaded.pool == "pool-c"
    routes = one(docs, "DaemonSet", "raven-routes-pool-c")
    assert env_of(routes)["RAVEN_L3_GATEWAY"] == "192.0.2.100"
    assert_valid(docs)
    # Plain Prometheus: its scrape jobs and rules as a ConfigMap, no Operator objects.
    assert set(one(docs, "ConfigMap", "raven-prometheus")["data"]) == {"scrape-config.yaml", "raven.rules.yaml"}
    assert not {"ServiceMonitor", "Certificate"} & {d["kind"] for d in docs}


def test_render_is_deterministic_and_secrets_only_on_request(layer3: tuple[Path, str]) -> None:
    tmp_path, without = layer3
    first = run(["-f", "answers.yaml", "--with-secrets"], tmp_path).stdout
    second = run(["-f", "answers.yaml", "--with-secrets"], tmp_path).stdout
    assert first == second
    docs = docs_of(first)
    assert_valid(docs)
    secrets = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "Secret"}
    assert secrets == {("kube-system", "raven-gateway-front-token"), ("monitoring", "raven-front-token"),
                       ("kube-system", "raven-gateway-tls"), ("kube-system", "raven-agent-tls-pool-a"),
                       ("kube-system", "raven-agent-tls-pool-c")}
    assert "kind: Secret" not in without
    assert docs_of(without) == [d for d in docs if d["kind"] != "Secret"]


@pytest.mark.parametrize(("args", "message"), [
    (["--pool", "pool-a"], "service_address"),
    (["--service-address", "10.96.0.999", "--pool", "pool-a"], "is not an IP address"),
    (["--service-address", "10.96.0.100"], "pools"),
    (["--service-address", "10.96.0.100", "--pool", "p=layer3"], "needs cidrs and lan_address"),
    (["--service-address", "10.96.0.100", "--pool", "Bad_Pool"], "pools.0.name"),
    (["--service-address", "10.96.0.100", "--pool", "a", "--kubectl", "/nonexistent/kubectl"], "no such program"),
])
def test_bad_answers_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    proc = run(args, tmp_path, check=False)
    assert proc.returncode != 0 and proc.stdout == ""
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


KUBEADM_COREDNS = {  # what `kubectl -n kube-system get deployment,configmap coredns -o yaml` prints (abridged)
    "apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": "coredns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"},
                      "annotations": {"deployment.kubernetes.io/revision": "1"}, "resourceVersion": "4242",
                      "uid": "0c0ffee0-0000-4000-8000-000000000001", "generation": 1,
                      "creationTimestamp": "2026-11-01T00:00:00Z", "managedFields": [{"manager": "kubeadm"}]},
         "spec": {"replicas": 2, "selector": {"matchLabels": {"k8s-app": "kube-dns"}},
                  "template": {"metadata": {"labels": {"k8s-app": "kube-dns"}}, "spec": {
                      "containers": [{"name": "coredns", "image": "registry.k8s.io/coredns/coredns:v1.11.3",
                                      "args": ["-conf", "/etc/coredns/Corefile"],
                                      "volumeMounts": [{"name": "config-volume", "mountPath": "/etc/coredns",
                                                        "readOnly": True}]}],
                      "volumes": [{"name": "config-volume", "configMap": {
                          "name": "coredns", "items": [{"key": "Corefile", "path": "Corefile"}]}}]}}},
         "status": {"replicas": 2, "readyReplicas": 2}},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": "coredns", "namespace": "kube-system", "resourceVersion": "233"},
         "data": {"Corefile": ".:53 {\n    errors\n    kubernetes cluster.local in-addr.arpa ip6.arpa {\n"
                  "       fallthrough in-addr.arpa ip6.arpa\n    }\n    forward . /etc/resolv.conf {\n"
                  "       max_concurrent 1000\n    }\n    cache 30\n    reload\n}\n"}},
    ]}


def test_coredns_is_patched_in_the_same_stream_and_passes_raven_checks(tmp_path: Path) -> None:
    """--coredns -: the cluster's CoreDNS objects come back with the mount and the hosts block (before forward),
    valid, nothing else of them changed, and the same again when run on its own output."""
    from raven.check import checks
    from raven.check.reader import ClusterView

    def install(given: str) -> list[dict[str, Any]]:
        proc = subprocess.run([*RAVEN, "install", *BASIC, "--coredns", "-"], cwd=tmp_path, input=given,
                              capture_output=True, text=True, timeout=180, check=False)
        assert proc.returncode == 0, proc.stderr
        return docs_of(proc.stdout)

    docs = install(yaml.safe_dump(KUBEADM_COREDNS))
    assert_valid(docs)
    dep, cm = one(docs, "Deployment", "coredns"), one(docs, "ConfigMap", "coredns")
    assert "status" not in dep and "resourceVersion" not in dep["metadata"] and "managedFields" not in dep["metadata"]
    original = KUBEADM_COREDNS["items"][0]["spec"]  # type: ignore[index]
    assert dep["spec"]["selector"] == original["selector"] and dep["spec"]["replicas"] == 2
    corefile = cm["data"]["Corefile"]
    assert corefile.index("hosts /etc/edge/tunnel-nodes") < corefile.index("forward .")
    view = ClusterView(coredns_deployment=dep, coredns_configmap=cm)
    assert all(r.ok for r in checks.coredns(view)), checks.coredns(view)
    again = install(yaml.safe_dump_all([dep, cm]))
    assert one(again, "Deployment", "coredns") == dep and one(again, "ConfigMap", "coredns") == cm
    bad = subprocess.run([*RAVEN, "install", *BASIC, "--coredns", "-"], cwd=tmp_path, input="kind: [",
                         capture_output=True, text=True, timeout=180, check=False)
    assert bad.returncode != 0 and "--coredns: not YAML" in bad.stderr and "Traceback" not in bad.stderr
