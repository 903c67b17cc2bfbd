"""The secret material of an installation: kept in files (made once, reused after), turned into Secrets on request.

- the front end's bearer token (``front-token``, 64 hex digits, mode 0600);
- the Raven CA (``ca.pem``, ``ca-key.pem``: :func:`raven.pki.create_ca`);
- with Raven's own CA instead of cert-manager: the gateway's and each pool's certificate
  (:func:`raven.pki.issue`), valid for the names the shipped cert-manager Certificate lists.

Files that exist are never replaced, so two renders from the same folder print the same Secrets. The Secrets'
contents appear in the output only with ``--with-secrets``; without it :func:`secret_commands` says how to create
them from the files.
"""

from __future__ import annotations

import base64
import os
import secrets as pysecrets
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raven import pki
from raven.install.answers import Answers

NAMESPACE = "kube-system"
TOKEN_FILE = "front-token"
GATEWAY_CERT = "raven-gateway"
PROMETHEUS_NAMESPACE = "monitoring"


@dataclass(frozen=True)
class SecretSpec:
    """One Secret to create: its namespace, name, and each key's file."""

    namespace: str
    name: str
    files: tuple[tuple[str, Path], ...]
    kind: str = "Opaque"


def agent_cert_name(pool: str) -> str:
    return f"agent-{pool}"


def _write_token(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(pysecrets.token_hex(32) + "\n")


def ensure_files(answers: Answers, directory: Path, gateway_dns: list[str]) -> list[Path]:
    """Make whatever is missing in ``directory`` (mode 0700); returns the files made now."""
    made: list[Path] = []
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = directory / TOKEN_FILE
    if not token.exists():
        _write_token(token)
        made.append(token)
    if not (directory / pki.CA_CERT_FILE).exists():
        made.extend(pki.create_ca(directory, common_name="Raven CA"))
    if answers.certificates == "raven":
        if not (directory / f"{GATEWAY_CERT}.pem").exists():
            made.extend(pki.issue(directory, directory, "gateway", GATEWAY_CERT, dns_names=gateway_dns))
        for pool in agent_pools(answers):
            name = agent_cert_name(pool.name)
            if not (directory / f"{name}.pem").exists():
                made.extend(pki.issue(directory, directory, "agent", name, pools=[pool.name], cidrs=pool.cidrs))
    return made


def agent_pools(answers: Answers) -> list[Any]:
    """The pools that get agents: tunnel and layer3 pools (a direct pool needs none)."""
    return [p for p in answers.pools if p.reach != "direct"]


def specs(answers: Answers, directory: Path) -> list[SecretSpec]:
    """Every Secret the installation needs, in a fixed order."""
    token = directory / TOKEN_FILE
    ca = directory / pki.CA_CERT_FILE
    out = [SecretSpec(NAMESPACE, "raven-gateway-front-token", (("token", token),))]
    if answers.monitoring == "prometheus":
        # Plain Prometheus reads its copy in its own namespace (deploy/prometheus/scrape-config.yaml).
        out.append(SecretSpec(PROMETHEUS_NAMESPACE, "raven-front-token", (("token", token),)))
    if answers.certificates == "cert-manager":
        out.append(SecretSpec(NAMESPACE, "raven-ca", (("tls.crt", ca), ("tls.key", directory / pki.CA_KEY_FILE)),
                              "kubernetes.io/tls"))
        return out

    def tls(secret: str, name: str) -> SecretSpec:
        return SecretSpec(NAMESPACE, secret, (("tls.crt", directory / f"{name}.pem"),
                                              ("tls.key", directory / f"{name}-key.pem"), ("ca.crt", ca)),
                          "kubernetes.io/tls")

    out.append(tls("raven-gateway-tls", GATEWAY_CERT))
    out.extend(tls(f"raven-agent-tls-{p.name}", agent_cert_name(p.name)) for p in agent_pools(answers))
    return out


def secret_object(spec: SecretSpec) -> dict[str, Any]:
    data = {key: base64.b64encode(path.read_bytes()).decode() for key, path in spec.files}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": spec.name, "namespace": spec.namespace,
                     "labels": {"app.kubernetes.io/part-of": "raven"}},
        "type": spec.kind,
        "data": data,
    }


def secret_commands(specs_: list[SecretSpec]) -> list[str]:
    """``kubectl create secret`` lines that make the Secrets from the files (their contents never printed)."""
    lines = []
    for spec in specs_:
        files = " ".join(f"--from-file={key}={shlex.quote(str(path))}" for key, path in spec.files)
        kind = "generic" if spec.kind == "Opaque" else "generic --type=kubernetes.io/tls"
        lines.append(f"kubectl -n {spec.namespace} create secret {kind} {spec.name} {files}")
    return lines
