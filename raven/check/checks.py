"""The checks of ``raven check``, each a pure function of what :mod:`raven.check.reader` read: one or more
:class:`~raven.check.results.Result` lines, and for every failure the command or change that fixes it.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from packaging.version import Version

from raven import pki, version
from raven.check.reader import GATEWAY, HOSTS_CONFIGMAP, NAMESPACE, ClusterView, Obj, secret_value
from raven.check.results import Result, failed, passed

MIN_CERT_DAYS = 14
LIST_AT_MOST = 5
DEFAULT_POOL_LABEL = "apps.openyurt.io/nodepool"
EDGE_WORKER_LABEL = "openyurt.io/is-edge-worker"
INSTALL = "raven install ... | kubectl apply -f -"
K = f"kubectl -n {NAMESPACE}"


def _names(names: Iterable[str]) -> str:
    items = sorted(names)
    more = f" and {len(items) - LIST_AT_MOST} more" if len(items) > LIST_AT_MOST else ""
    return ", ".join(items[:LIST_AT_MOST]) + more


def _containers(workload: Obj | None) -> list[Obj]:
    return list((((workload or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or [])


def _env(workload: Obj | None) -> dict[str, str]:
    return {str(e.get("name")): str(e.get("value", "")) for c in _containers(workload) for e in c.get("env") or []
            if "value" in e}


def _ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _config(view: ClusterView, *path: str, default: Any = None) -> Any:
    node: Any = view.gateway_config or {}
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def pool_label(view: ClusterView) -> str:
    return str(_config(view, "kubernetes", "pool_label", default=DEFAULT_POOL_LABEL) or DEFAULT_POOL_LABEL)


def agent_pools(view: ClusterView) -> dict[str, Obj]:
    """The agent Deployment of each pool (by its RAVEN_POOL)."""
    return {_env(d).get("RAVEN_POOL", ""): d for d in view.agents if _env(d).get("RAVEN_POOL")}


def configured_pools(view: ClusterView) -> dict[str, str]:
    """Every pool the installation knows and its reach: the gateway's pools (file, then RAVEN_POOLS as the
    DaemonSet sets it), and every pool that has agents (tunnel unless said otherwise)."""
    pools: dict[str, str] = {p: "tunnel" for p in agent_pools(view)}
    sources: list[Any] = [_config(view, "pools", default={})]
    raw = _env(view.gateway_workload).get("RAVEN_POOLS")
    if raw:
        try:
            sources.append(json.loads(raw))
        except ValueError:
            pass
    for source in sources:
        if isinstance(source, dict):
            for name, settings in source.items():
                reach = settings.get("reach") if isinstance(settings, dict) else None
                pools[str(name)] = str(reach or pools.get(str(name), "tunnel"))
    return pools


# ---------------------------------------------------------------------------------------------------------------


def gateway_pods(view: ClusterView) -> Result:
    name = "gateway-pods"
    workload = view.gateway_workload
    if workload is None:
        return failed(name, f"no DaemonSet or Deployment {GATEWAY} in {NAMESPACE}", f"install Raven: {INSTALL}")
    not_ready = [p["metadata"]["name"] for p in view.gateway_pods if not _ready(p)]
    status = workload.get("status") or {}
    if workload.get("kind") == "DaemonSet":
        want, have = int(status.get("desiredNumberScheduled") or 0), int(status.get("numberReady") or 0)
        what = f"{have} of {want} cloud nodes have a ready gateway"
    else:
        want = int((workload.get("spec") or {}).get("replicas") or 1)
        have = int(status.get("readyReplicas") or 0)
        what = f"{have} of {want} gateway replicas ready"
    if not view.gateway_pods or not_ready or have < want or want == 0:
        pods = f"; not ready: {_names(not_ready)}" if not_ready else ""
        first = not_ready[0] if not_ready else f"-l app.kubernetes.io/name={GATEWAY}"
        return failed(name, what + pods, f"{K} describe pod {first}; {K} logs {first} "
                      "(a gateway is ready once its agents are back, at most ready_max_wait)")
    return passed(name, what)


def hosts_entries(view: ClusterView) -> list[tuple[str, str]]:
    """(address, name) of the published hosts file's lines for nodes Raven reaches: a node of a direct or layer3
    pool is listed at its own address (hosts.direct: internal-ip), not at the Service's."""
    pools = configured_pools(view)
    label = pool_label(view)
    elsewhere = {str(n["metadata"]["name"]) for n in view.nodes
                 if pools.get(((n.get("metadata") or {}).get("labels") or {}).get(label, ""), "tunnel") != "tunnel"}
    out = []
    for text in ((view.hosts_configmap or {}).get("data") or {}).values():
        for line in str(text).splitlines():
            words = line.split("#", 1)[0].split()
            out += [(words[0], name) for name in words[1:] if name not in elsewhere]
    return out


def _hosts_addresses(view: ClusterView) -> set[str]:
    return {address for address, _ in hosts_entries(view)}


def service_address(view: ClusterView) -> Result:
    name = "service-address"
    if view.front_service is None:
        return failed(name, f"no Service {GATEWAY} in {NAMESPACE}", f"install Raven: {INSTALL}")
    spec = view.front_service.get("spec") or {}
    service = set(spec.get("clusterIPs") or [spec.get("clusterIP")]) - {None, "", "None"}
    in_file = _hosts_addresses(view)
    source = f"the hosts file (ConfigMap {HOSTS_CONFIGMAP})"
    if not in_file:  # no edge node published yet: what the gateway will write
        raw = _env(view.gateway_workload).get("RAVEN_HOSTS__SERVICE_ADDRESSES")
        try:
            in_file = {str(a) for a in (json.loads(raw) if raw else _config(view, "hosts", "service_addresses",
                                                                              default=[]))}
        except ValueError:
            in_file = set()
        source = "the gateway's hosts.service_addresses"
    if not in_file:
        return failed(name, f"{source} names no address: edge names resolve to nothing",
                      f"{INSTALL} with --service-address {_names(service) or 'IP'}")
    if not in_file <= service:
        return failed(name, f"{source} says {_names(in_file)}, the Service {GATEWAY} has {_names(service)}",
                      f"give the gateway the Service's address: raven install --service-address "
                      f"{sorted(service)[0] if service else 'IP'} ... | kubectl apply -f -")
    return passed(name, f"the Service {GATEWAY} is {_names(service)}, as {source} says")


def _coredns_mounts(view: ClusterView) -> list[str]:
    """The hosts files CoreDNS's pod sees from Raven's ConfigMap(s): mountPath/item path."""
    spec = (((view.coredns_deployment or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
    volumes = {v.get("name"): v["configMap"] for v in spec.get("volumes") or []
               if str((v.get("configMap") or {}).get("name", "")).startswith(HOSTS_CONFIGMAP)}
    paths = []
    for c in spec.get("containers") or []:
        for m in c.get("volumeMounts") or []:
            if m.get("name") in volumes:
                items = volumes[m["name"]].get("items") or [{"path": "tunnel-nodes"}]
                paths += [f"{str(m.get('mountPath', '')).rstrip('/')}/{i.get('path')}" for i in items]
    return sorted(paths)


def coredns(view: ClusterView) -> list[Result]:
    out = []
    patch = f"{K} patch deployment coredns --type strategic --patch-file deploy/coredns/coredns-patch.yaml"
    mounts = _coredns_mounts(view)
    if view.coredns_deployment is None:
        out.append(failed("coredns-mount", f"no Deployment coredns in {NAMESPACE}",
                          "Raven's DNS mode needs CoreDNS (or use the proxy mode: "
                          "deploy/prometheus/scrape-config.yaml)"))
    elif not mounts:
        out.append(failed("coredns-mount", f"the coredns Deployment does not mount ConfigMap {HOSTS_CONFIGMAP}", patch))
    else:
        out.append(passed("coredns-mount", f"coredns mounts the hosts file at {_names(mounts)}"))
    corefile = str(((view.coredns_configmap or {}).get("data") or {}).get("Corefile", ""))
    wanted = mounts or ["/etc/edge/tunnel-nodes"]
    missing = [p for p in wanted if not re.search(rf"(?m)^\s*hosts\s+{re.escape(p)}(\s|$)", corefile)]
    if view.coredns_configmap is None:
        out.append(failed("coredns-corefile", f"no ConfigMap coredns in {NAMESPACE}", "is CoreDNS the cluster DNS?"))
    elif missing:
        out.append(failed("coredns-corefile", f"the Corefile has no hosts block for {_names(missing)}",
                          f"{K} edit configmap coredns: paste deploy/coredns/Corefile.snippet into the .:53 block, "
                          "before forward"))
    else:
        out.append(passed("coredns-corefile", f"the Corefile serves {_names(wanted)} (hosts plugin)"))
    return out


def node_pools(view: ClusterView) -> Result:
    name = "node-pools"
    label = pool_label(view)
    pools = configured_pools(view)
    unknown: dict[str, list[str]] = {}
    unlabelled = []
    for node in view.nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        node_name = str(node["metadata"]["name"])
        pool = labels.get(label)
        if pool is None:
            if labels.get(EDGE_WORKER_LABEL) == "true":
                unlabelled.append(node_name)
        elif pool not in pools:
            unknown.setdefault(str(pool), []).append(node_name)
    fixes, found = [], []
    if unlabelled:
        found.append(f"edge nodes without a {label} label: {_names(unlabelled)}")
        fixes.append(f"kubectl label node {unlabelled[0]} {label}=POOL")
    for pool, nodes in sorted(unknown.items()):
        found.append(f"pool {pool} (nodes {_names(nodes)}) is not configured")
        fixes.append(f"raven install ... --pool {pool} | kubectl apply -f -")
    if found:
        return failed(name, "; ".join(found), "\n".join(fixes))
    labelled = sum(1 for n in view.nodes if label in ((n.get("metadata") or {}).get("labels") or {}))
    return passed(name, f"{labelled} nodes labelled {label}, all in configured pools ({_names(pools) or 'none'})")


def ops_reachable(statuses: dict[str, Obj | str]) -> Result:
    if not statuses:
        return failed("ops-api", "no gateway ops listener to ask (no gateway Pod has an address)",
                      "pass --gateway http://HOST:10265 (e.g. after kubectl -n kube-system port-forward POD 10265)")
    bad = [s for s in statuses.values() if isinstance(s, str)]
    if bad:
        return failed("ops-api", "; ".join(bad),
                      "run raven check where the pod network is reachable (in a pod), or pass --gateway "
                      f"http://localhost:10265 after {K} port-forward pod/POD 10265 (and --token-file)")
    return passed("ops-api", f"read /status of {len(statuses)} gateway replica(s)")


def _status_docs(statuses: dict[str, Obj | str]) -> list[Obj]:
    return [s for s in statuses.values() if isinstance(s, dict)]


def pool_agents(view: ClusterView, statuses: dict[str, Obj | str]) -> list[Result]:
    out = []
    deployments = agent_pools(view)
    docs = _status_docs(statuses)
    for pool, reach in sorted(configured_pools(view).items()):
        if reach == "direct":
            continue
        name = f"agents {pool}"
        dep = deployments.get(pool)
        if dep is None:
            out.append(failed(name, f"{reach} pool {pool} has no agent Deployment",
                              f"raven install ... --pool {pool}{'=layer3' if reach == 'layer3' else ''} "
                              "| kubectl apply -f -"))
            continue
        dep_name = dep["metadata"]["name"]
        ready = int((dep.get("status") or {}).get("readyReplicas") or 0)
        if ready < 1:
            out.append(failed(name, f"no ready agent in {dep_name}",
                              f"{K} logs deploy/{dep_name} (TLS, or the edge cannot reach the gateway pods on 10262)"))
            continue
        without = []
        for doc in docs:
            entry = next((p for p in doc.get("pools") or [] if p.get("pool") == pool), None)
            if not any(not a.get("draining") for a in (entry or {}).get("agents") or []):
                without.append(str(doc.get("replica", "?")))
        if without:
            out.append(failed(name, f"{ready} ready agent(s), but no session to replica(s) {_names(without)}",
                              f"{K} logs deploy/{dep_name}: can the edge reach every gateway pod on 10262?"))
        else:
            out.append(passed(name, f"{ready} ready agent(s), sessions to {len(docs)} of {len(docs)} replicas"))
    return out


def _cert_days(secret: Obj | None, now: dt.datetime) -> tuple[float | None, str]:
    pem = secret_value(secret, "tls.crt")
    if pem is None:
        return None, "has no tls.crt"
    try:
        cert = x509.load_pem_x509_certificate(pem)
        identity = pki.identity_from_der(cert.public_bytes(Encoding.DER))
    except (ValueError, pki.PKIError) as exc:
        return None, f"tls.crt is not a certificate ({exc})"
    return (identity.not_after - now).total_seconds() / 86400, ""


def certificates(view: ClusterView, now: dt.datetime) -> list[Result]:
    out = []
    for secret_name, secret in sorted(view.secrets.items()):
        if not secret_name.startswith(("raven-gateway-tls", "raven-agent-tls")):
            continue
        name = f"cert {secret_name}"
        renew = (f"cert-manager: {K} describe certificate (the one with secretName {secret_name}); Raven's CA: "
                 f"raven install --certificates raven --with-secrets after removing the old files")
        if secret is None:
            out.append(failed(name, f"Secret {secret_name} does not exist", renew))
            continue
        days, problem = _cert_days(secret, now)
        if days is None:
            out.append(failed(name, f"Secret {secret_name} {problem}", renew))
        elif days < MIN_CERT_DAYS:
            what = "expired" if days < 0 else f"expires in {days:.1f} days"
            out.append(failed(name, f"{what} (less than {MIN_CERT_DAYS})", renew))
        else:
            out.append(passed(name, f"valid for {days:.0f} more days"))
    return out


def supported(gateway: str, agent: str) -> bool:
    """docs/skew.md: a gateway of minor N serves agents of N-2 .. N+1 (same major; patches never matter)."""
    gw, ag = version.parse(gateway), version.parse(agent)
    if gw is None or ag is None or gw.major != ag.major:
        return False
    return gw.minor - 2 <= ag.minor <= gw.minor + 1


def release_skew(statuses: dict[str, Obj | str]) -> Result:
    name = "release-skew"
    docs = _status_docs(statuses)
    if not docs:
        return failed(name, "no gateway /status to read releases from", "see ops-api above")
    bad: dict[str, set[str]] = {}
    releases = set()
    for doc in docs:
        gw = str(doc.get("version") or version.UNANNOUNCED)
        releases.add(gw)
        for pool in doc.get("pools") or []:
            for agent in pool.get("agents") or []:
                ag = str(agent.get("version") or "")
                if not supported(gw, ag):
                    bad.setdefault(f"{pool.get('pool')} ({version.peer_release(ag)})", set()).add(gw)
    if bad:
        newest = max(releases, key=lambda r: version.parse(r) or Version("0"))
        return failed(name, f"agents outside the skew policy of gateway {_names(releases)}: {_names(bad)}",
                      f"upgrade those pools' agents: raven install --image REPOSITORY:{newest} ... | kubectl apply "
                      "-f - (docs/skew.md: a gateway serves agents two minor releases older to one newer)")
    return passed(name, f"gateway {_names(releases)}; every agent within docs/skew.md's policy")


CHECKS: tuple[Callable[..., Any], ...] = (gateway_pods, service_address, coredns, node_pools)


def run_all(view: ClusterView, statuses: dict[str, Obj | str], now: dt.datetime) -> list[Result]:
    out: list[Result] = []
    for check in CHECKS:
        got = check(view)
        out.extend(got if isinstance(got, list) else [got])
    out.append(ops_reachable(statuses))
    out.extend(pool_agents(view, statuses))
    out.extend(certificates(view, now))
    out.append(release_skew(statuses))
    return out
