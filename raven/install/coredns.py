"""``raven install --coredns FILE``: the cluster's own CoreDNS Deployment and ConfigMap (as
``kubectl -n kube-system get deployment,configmap coredns -o yaml`` printed them) with Raven's hosts file mounted
(deploy/coredns/coredns-patch.yaml, merged by name as ``kubectl patch --type strategic`` would) and served
(deploy/coredns/Corefile.snippet, inserted in the ``.:53`` block before ``forward``).

Only those two changes are made: everything else of the objects is printed as read (less what the API server
owns: status, resourceVersion, uid, managedFields ...), so ``kubectl apply -f -`` changes nothing else. Running it
on objects already patched changes nothing (the mount is replaced by name, the block is not added twice).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from raven.errors import ConfigError

Obj = dict[str, Any]
SERVER_OWNED = ("resourceVersion", "uid", "creationTimestamp", "managedFields", "generation", "selfLink")
MAX_INPUT = 4 << 20


def _objects(text: str) -> list[Obj]:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError as exc:
        raise ConfigError(f"--coredns: not YAML ({str(exc).splitlines()[0]})") from None
    out: list[Obj] = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise ConfigError("--coredns: a document is not a Kubernetes object")
        if doc.get("kind") == "List":
            out.extend(i for i in doc.get("items") or [] if isinstance(i, dict))
        else:
            out.append(doc)
    return out


def _clean(obj: Obj) -> Obj:
    meta = dict(obj.get("metadata") or {})
    for key in SERVER_OWNED:
        meta.pop(key, None)
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if k != "kubectl.kubernetes.io/last-applied-configuration"}
    meta.pop("annotations", None)
    if annotations:
        meta["annotations"] = annotations
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": meta}


def _merge(items: list[Obj], wanted: list[Obj], key: str) -> list[Obj]:
    """``items`` with each of ``wanted`` replacing the one of the same ``key`` (or added at the end)."""
    out = [i for i in items if i.get(key) not in {w.get(key) for w in wanted}]
    return out + wanted


def patch_deployment(deployment: Obj, patch: Obj) -> Obj:
    spec = deployment.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
    want = patch["spec"]["template"]["spec"]
    spec["volumes"] = _merge(list(spec.get("volumes") or []), want["volumes"], "name")
    containers = spec.get("containers") or []
    target = next((c for c in containers if c.get("name") == "coredns"), containers[0] if containers else None)
    if target is None:
        raise ConfigError("--coredns: the coredns Deployment has no container")
    target["volumeMounts"] = _merge(list(target.get("volumeMounts") or []),
                                    want["containers"][0]["volumeMounts"], "mountPath")
    return deployment


def patch_corefile(corefile: str, snippet: str) -> str:
    if re.search(r"(?m)^\s*hosts\s+/etc/edge/tunnel-nodes(\s|$)", corefile):
        return corefile
    block = re.search(r"(?m)^\.:53\s*\{[^\n]*\n", corefile)
    if block is None:
        raise ConfigError("--coredns: the Corefile has no '.:53 {' block: paste deploy/coredns/Corefile.snippet "
                          "into the block that serves the cluster's names by hand")
    start = block.end()
    forward = re.compile(r"(?m)^[ \t]*forward\s").search(corefile, start)
    end = re.compile(r"(?m)^\}").search(corefile, start)
    at = forward.start() if forward is not None and (end is None or forward.start() < end.start()) else (
        end.start() if end is not None else len(corefile))
    return corefile[:at] + snippet.rstrip("\n") + "\n" + corefile[at:]


def render(text: str, root: Path) -> list[Obj]:
    """The patched Deployment and ConfigMap from ``kubectl get`` output ``text``; ConfigError says what is wrong."""
    if len(text) > MAX_INPUT:
        raise ConfigError(f"--coredns: more than {MAX_INPUT >> 20} MiB: give it the coredns Deployment and ConfigMap")
    objects = _objects(text)
    found = {(o.get("kind"), (o.get("metadata") or {}).get("name")): o for o in objects}
    deployment, configmap = found.get(("Deployment", "coredns")), found.get(("ConfigMap", "coredns"))
    if deployment is None or configmap is None:
        missing = "Deployment coredns" if deployment is None else "ConfigMap coredns"
        raise ConfigError(f"--coredns: no {missing} in the input: kubectl -n kube-system get deployment,configmap "
                          "coredns -o yaml")
    corefile = (configmap.get("data") or {}).get("Corefile")
    if not isinstance(corefile, str):
        raise ConfigError("--coredns: ConfigMap coredns has no Corefile")
    patch = yaml.safe_load((root / "deploy" / "coredns" / "coredns-patch.yaml").read_text())
    snippet = (root / "deploy" / "coredns" / "Corefile.snippet").read_text()
    new_configmap = _clean(configmap)
    new_configmap["data"] = {**configmap["data"], "Corefile": patch_corefile(corefile, snippet)}
    return [patch_deployment(_clean(deployment), patch), new_configmap]
