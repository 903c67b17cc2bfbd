"""What ``raven check`` reads, all at once and read-only: the cluster's objects (through the project's Kubernetes
client, kubeconfig or in-cluster) and every gateway replica's ``/status`` from its ops listener.

Nothing here judges: :mod:`raven.check.checks` does, from the :class:`ClusterView` built here. A missing object
is None (a check says what that means); an API error other than 404 ends the command with the reason.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client

from raven.errors import CommandFailed
from raven.kube.client import KubeApiError, api_client, call_json
from raven.ops import client as ops_client

Obj = dict[str, Any]
NAMESPACE = "kube-system"
GATEWAY = "raven-gateway"
GATEWAY_SELECTOR = "app.kubernetes.io/name=raven-gateway"
AGENT_SELECTOR = "app.kubernetes.io/name=raven-agent"
HOSTS_CONFIGMAP = "edge-tunnel-nodes"
TOKEN_SECRET = "raven-gateway-front-token"
OPS_PORT = 10265
OPERATED_PROMETHEUS = "operated-prometheus=true"  # the Prometheus Operator's governing Service
MAX_METRICS_BYTES = 8 << 20  # a gateway's /metrics: series per pool, not per node


@dataclass(frozen=True)
class Clock:
    """Another machine's wall clock against this one's, from one request: ``offset`` (theirs minus ours, seconds)
    give or take ``error`` (half the round trip, plus a second when the reading is a Date header's whole seconds).
    """

    offset: float
    error: float

    @staticmethod
    def of(sent: float, received: float, theirs: float, whole_seconds: bool) -> Clock:
        half = (received - sent) / 2
        if whole_seconds:  # a Date header truncates: their clock was in [theirs, theirs + 1)
            return Clock(theirs + 0.5 - (sent + half), half + 0.5)
        return Clock(theirs - (sent + half), half)


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
    prometheus_services: list[Obj] = field(default_factory=list)  # the Operator's prometheus-operated Services
    api_clock: Clock | None = None  # the API server's Date against this machine's clock (None: it sent none)


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
        found = await get(v1.list_service_for_all_namespaces, label_selector=OPERATED_PROMETHEUS)
        view.prometheus_services = list((found or {}).get("items") or [])
        view.api_clock = await _api_clock(client.VersionApi(api), timeout)
        return view
    finally:
        await api.close()


async def _api_clock(version_api: client.VersionApi, timeout: float) -> Clock | None:
    """The API server's clock, from the Date header of its answer to ``GET /version``."""
    sent = time.time()
    try:
        async with asyncio.timeout(timeout):
            resp: aiohttp.ClientResponse = await version_api.get_code(  # type: ignore[assignment]
                _preload_content=False, _request_timeout=timeout)
            try:
                await resp.read()
                date = resp.headers.get("Date")
            finally:
                resp.release()
    except (TimeoutError, aiohttp.ClientError, KubeApiError):
        return None
    theirs = ops_client.parse_date(date)
    return Clock.of(sent, time.time(), theirs, whole_seconds=True) if theirs is not None else None


@dataclass(frozen=True)
class ReplicaRead:
    """One replica's ``/status`` and, when it could be read, its ``/metrics`` (None: not read) and the reply's
    clock readings; or why it could not be read (``error``)."""

    status: Obj | None
    error: str = ""
    metrics: str | None = None
    reply: ops_client.Reply | None = None


async def fetch_replica(url: str, token: str | None, timeout: float) -> ReplicaRead:
    """One replica's ``/status`` and ``/metrics`` (raven/ops/client.py: bounded), or a sentence saying why not."""
    try:
        reply = await ops_client.get(url.rstrip("/") + "/status", token, timeout)
        doc = reply.json()
        if not isinstance(doc, dict):
            return ReplicaRead(None, f"{url}/status is not a Raven gateway's status")
    except ops_client.OpsReadError as exc:
        return ReplicaRead(None, str(exc))
    try:
        metrics = (await ops_client.get(url.rstrip("/") + "/metrics", None, timeout, MAX_METRICS_BYTES)).body
        text: str | None = metrics.decode("utf-8", "replace")
    except ops_client.OpsReadError:
        text = None
    return ReplicaRead(doc, metrics=text, reply=reply)


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


async def read_replicas(urls: list[str], token: str | None, timeout: float) -> dict[str, ReplicaRead]:
    results = await asyncio.gather(*(fetch_replica(u, token, timeout) for u in urls))
    return dict(zip(urls, results, strict=True))
