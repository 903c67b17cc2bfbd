"""``raven check --pre``: is this cluster ready for ``raven install``? The API server's version (the manifests are
written for Kubernetes 1.30 or newer), CoreDNS present, cert-manager's CRDs present when it is to issue the
certificates, and the chosen front Service address not taken by another Service.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client

from raven.check.reader import GATEWAY, NAMESPACE, Obj
from raven.check.results import Result, failed, passed
from raven.errors import CommandFailed
from raven.kube.client import KubeApiError, api_client, call_json

MIN_MINOR = 30  # tests/support/schemas.py: the oldest Kubernetes the manifests are validated against
CERT_MANAGER_CRD = "certificates.cert-manager.io"


def api_version(info: Obj | None) -> Result:
    if info is None:
        return failed("api-version", "the API server did not say its version", "kubectl version")
    major, minor = str(info.get("major", "")), str(info.get("minor", "")).rstrip("+")
    text = str(info.get("gitVersion") or f"{major}.{minor}")
    if not (major.isdigit() and minor.isdigit()) or (int(major), int(minor)) < (1, MIN_MINOR):
        return failed("api-version", f"Kubernetes {text}; Raven's manifests need 1.{MIN_MINOR} or newer",
                      "upgrade the cluster")
    return passed("api-version", f"Kubernetes {text}")


def coredns_present(deployment: Obj | None, configmap: Obj | None) -> Result:
    if deployment is None or configmap is None or "Corefile" not in (configmap.get("data") or {}):
        missing = "Deployment coredns" if deployment is None else "ConfigMap coredns (key Corefile)"
        return failed("coredns", f"no {missing} in {NAMESPACE}",
                      "DNS mode needs CoreDNS; without it use the proxy mode (deploy/prometheus/scrape-config.yaml, "
                      "job edge-dcgm-proxy)")
    return passed("coredns", f"CoreDNS is in {NAMESPACE}")


def cert_manager(crd: Obj | None, wanted: str) -> Result | None:
    if wanted != "cert-manager":
        return None
    if crd is None:
        return failed("cert-manager", f"no CRD {CERT_MANAGER_CRD}: cert-manager is not installed",
                      "install cert-manager (https://cert-manager.io/docs/installation/), or raven install "
                      "--certificates raven")
    return passed("cert-manager", "cert-manager's Certificate CRD is installed")


def address_free(address: str | None, services: list[Obj]) -> Result:
    name = "service-address"
    if address is None:
        return failed(name, "no address to check", "pass --service-address IP (a free address in the service CIDR)")
    try:
        wanted = str(ipaddress.ip_address(address))
    except ValueError:
        return failed(name, f"{address!r} is not an IP address", "pass --service-address IP")
    for svc in services:
        meta, spec = svc.get("metadata") or {}, svc.get("spec") or {}
        if (meta.get("namespace"), meta.get("name")) == (NAMESPACE, GATEWAY):
            continue  # Raven's own Service, from an earlier install
        if wanted in (spec.get("clusterIPs") or [spec.get("clusterIP")]):
            return failed(name, f"{wanted} is taken by Service {meta.get('namespace')}/{meta.get('name')}",
                          "choose another free address in the service CIDR (--service-cluster-ip-range)")
    return passed(name, f"{wanted} is not used by any Service")


async def run(kubeconfig: Path | None, address: str | None, wanted_certs: str, timeout: float) -> list[Result]:
    api = await api_client(kubeconfig, timeout)
    try:
        async def get(func: Callable[..., Awaitable[Any]], *args: Any) -> Obj | None:
            try:
                return await call_json(func, *args, timeout=timeout)
            except KubeApiError as exc:
                if exc.status == 404:
                    return None
                raise CommandFailed(f"cannot read {func.__name__}: {exc}") from None
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise CommandFailed(f"the API server did not answer ({func.__name__}): {exc}") from None

        v1, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        out = [api_version(await get(client.VersionApi(api).get_code))]
        out.append(coredns_present(await get(apps.read_namespaced_deployment, "coredns", NAMESPACE),
                                   await get(v1.read_namespaced_config_map, "coredns", NAMESPACE)))
        crd = None
        if wanted_certs == "cert-manager":
            crd = await get(client.ApiextensionsV1Api(api).read_custom_resource_definition, CERT_MANAGER_CRD)
        cm = cert_manager(crd, wanted_certs)
        if cm is not None:
            out.append(cm)
        services = await get(v1.list_service_for_all_namespaces)
        out.append(address_free(address, list((services or {}).get("items") or [])))
        return out
    finally:
        await api.close()
