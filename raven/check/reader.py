"""What ``raven check`` reads, all at once and read-only: the cluster's objects (through the project's Kubernetes
client, kubeconfig or in-cluster) and every gateway replica's ``/status`` from its ops listener.

Nothing here judges: :mod:`raven.check.checks` does, from the :class:`ClusterView` built here. A missing object
is None (a check says what that means); an API error other than 404 ends the command with the reason.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client

from raven.errors import CommandFailed
from raven.kube.client import KubeApiError, api_client, call_json

Obj = dict[str, Any]
NAMESPACE = "kube-system"
GATEWAY = "raven-gateway"
GATEWAY_SELECTOR = "app.kubernetes.io/name=raven-gateway"
AGENT_SELECTOR = "app.kubernetes.io/name=raven-agent"
HOSTS_CONFIGMAP = "edge-tunnel-nodes"
TOKEN_SECRET = "raven-gateway-front-token"
OPS_PORT = 10265
MAX_STATUS_BYTES = 64 << 20  # one replica's /status for 10,000 nodes is a few MB


@dataclass
class ClusterView:
    gateway_pods: list[Obj] = field(default_factory=list)
    gateway_workload: Obj | None = None  # the DaemonSet raven-gateway, else the Deployment
    gateway_config: Obj | None = None  # gateway.yaml from ConfigMap raven-gateway-config
    front_service: Obj | None = None
    hosts_configmap: Obj | None = None
    coredns_configmap: Obj | None = None
    coredns_deployment: Obj | None = None
    dns_service: Obj | None = None  # kube-system/kube-dns: the cluster DNS's ClusterIP
    nodes: list[Obj] = field(default_factory=list)
    agents: list[Obj] = field(default_factory=list)  # agent Deployments, one per pool
    secrets: dict[str, Obj | None] = field(default_factory=dict)  # TLS Secrets by name
    statuses: dict[str, Obj | str] = field(default_factory=dict)  # ops URL -> /status, or why it could not be read


def secret_value(secret: Obj | None, key: str) -> bytes | None:
    data = (secret or {}).get("data") or {}
    if key not in data:
        return None
    try:
        return base64.b64decode(str(data[key]), validate=True)
    except ValueError:
        return None


def tls_secret_names(workloads: list[Obj | None]) -> list[str]:
    """The Secrets mounted as the ``tls`` volume of the gateway and each agent Deployment."""
    names = []
    for w in workloads:
        for v in (((w or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("volumes") or []:
            secret = (v.get("secret") or {}).get("secretName")
            if v.get("name") == "tls" and secret:
                names.append(str(secret))
    return sorted(set(names))


async def read_cluster(kubeconfig: Path | None, timeout: float) -> ClusterView:
    api = await api_client(kubeconfig, timeout)
    try:
        v1, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        view = ClusterView()

        async def get(func: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Obj | None:
            try:
                return await call_json(func, *args, timeout=timeout, **kw)
            except KubeApiError as exc:
                if exc.status == 404:
                    return None
                raise CommandFailed(f"cannot read {func.__name__.split('_', 2)[-1]} {' '.join(map(str, args))}: "
                                    f"{exc}") from None
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise CommandFailed(f"the API server did not answer ({func.__name__}): "
                                    f"{type(exc).__name__}: {exc}") from None

        pods = await get(v1.list_namespaced_pod, NAMESPACE, label_selector=GATEWAY_SELECTOR)
        view.gateway_pods = sorted((pods or {}).get("items") or [], key=lambda p: p["metadata"]["name"])
        view.gateway_workload = (await get(apps.read_namespaced_daemon_set, GATEWAY, NAMESPACE)
                                 or await get(apps.read_namespaced_deployment, GATEWAY, NAMESPACE))
        config = await get(v1.read_namespaced_config_map, "raven-gateway-config", NAMESPACE)
        text = ((config or {}).get("data") or {}).get("gateway.yaml")
        if text:
            try:
                loaded = yaml.safe_load(text)
                view.gateway_config = loaded if isinstance(loaded, dict) else None
            except yaml.YAMLError:
                view.gateway_config = None
        view.front_service = await get(v1.read_namespaced_service, GATEWAY, NAMESPACE)
        view.hosts_configmap = await get(v1.read_namespaced_config_map, HOSTS_CONFIGMAP, NAMESPACE)
        view.coredns_configmap = await get(v1.read_namespaced_config_map, "coredns", NAMESPACE)
        view.coredns_deployment = await get(apps.read_namespaced_deployment, "coredns", NAMESPACE)
        view.dns_service = await get(v1.read_namespaced_service, "kube-dns", NAMESPACE)
        nodes = await get(v1.list_node)
        view.nodes = sorted((nodes or {}).get("items") or [], key=lambda n: n["metadata"]["name"])
        agents = await get(apps.list_namespaced_deployment, NAMESPACE, label_selector=AGENT_SELECTOR)
        view.agents = sorted((agents or {}).get("items") or [], key=lambda d: d["metadata"]["name"])
        for name in tls_secret_names([view.gateway_workload, *view.agents]):
            view.secrets[name] = await get(v1.read_namespaced_secret, name, NAMESPACE)
        view.secrets[TOKEN_SECRET] = await get(v1.read_namespaced_secret, TOKEN_SECRET, NAMESPACE)
        return view
    finally:
        await api.close()


async def fetch_status(url: str, token: str | None, timeout: float) -> Obj | str:
    """One replica's ``/status``, or a sentence saying why it could not be read."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            async with http.get(url.rstrip("/") + "/status", headers=headers) as resp:
                if resp.status == 401:
                    return f"{url} refused the token (401): pass --token-file with one of front.auth's tokens"
                if resp.status != 200:
                    return f"{url}/status answered HTTP {resp.status}"
                body = await resp.content.read(MAX_STATUS_BYTES + 1)
                if len(body) > MAX_STATUS_BYTES:
                    return f"{url}/status is larger than {MAX_STATUS_BYTES >> 20} MiB"
                doc = json.loads(body)
                return doc if isinstance(doc, dict) else f"{url}/status is not a Raven gateway's status"
    except (aiohttp.ClientError, OSError) as exc:
        return f"cannot reach {url}: {type(exc).__name__}: {exc}"
    except TimeoutError:
        return f"{url} did not answer within {timeout:g}s"
    except ValueError:
        return f"{url}/status is not JSON (is it a Raven gateway's ops listener?)"


def ops_urls(view: ClusterView, explicit: list[str]) -> list[str]:
    """The ops listeners to ask: the ones given, else every gateway Pod's own address (reachable in the cluster)."""
    if explicit:
        return list(explicit)
    urls = []
    for pod in view.gateway_pods:
        ip = (pod.get("status") or {}).get("podIP")
        if ip:
            host = f"[{ip}]" if ":" in ip else ip
            urls.append(f"http://{host}:{OPS_PORT}")
    return urls


async def read_statuses(urls: list[str], token: str | None, timeout: float) -> dict[str, Obj | str]:
    results = await asyncio.gather(*(fetch_status(u, token, timeout) for u in urls))
    return dict(zip(urls, results, strict=True))
