"""The descriptor check of ``raven check``: each gateway replica's open-files limit against what the fleet needs.

A replica's need: the front end's keep-alive connections, one per scrape target reached through Raven per
Prometheus replica (an HA pair: two per target), spread over the gateway replicas with one of them away (a
rolling restart); plus its agent sessions; plus ``front.fd_reserve`` (the tunnel and ops ports, files). Targets
per node come from Prometheus when it was read (its edge jobs' targets over the tunnel nodes), else one
(dcgm-exporter). The limit and the use are the replica's own ``process_max_fds`` and ``process_open_fds``
(its /metrics). The replica's ``front.max_connections`` must admit the same connections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from raven.check.reader import ClusterView, Obj, ReplicaRead
from raven.check.results import Result, failed, passed
from raven.config.gateway import GatewayFront

NAME = "descriptors"
BUSY = 0.9  # open descriptors beyond this share of the limit: the next burst of connections is refused
FIX = ("raise the gateway container's open-files limit to at least {need}: the container runtime's LimitNOFILE "
       "(containerd's or CRI-O's systemd unit on the cloud nodes; docs/performance.md), then "
       "kubectl -n kube-system rollout restart daemonset/raven-gateway")


@dataclass(frozen=True)
class Need:
    front: int  # Prometheus's connections this replica must hold
    sessions: int
    reserve: int
    nodes: int
    per_node: float
    prometheus_replicas: int

    @property
    def total(self) -> int:
        return self.front + self.sessions + self.reserve

    def explain(self) -> str:
        return (f"{self.front} Prometheus connections ({self.nodes} tunnel nodes x {self.per_node:g} targets x "
                f"{self.prometheus_replicas} Prometheus replicas, over the gateway replicas with one away) + "
                f"{self.sessions} agent sessions + {self.reserve} front.fd_reserve")


def process_fds(text: str | None) -> tuple[float | None, float | None]:
    """``process_open_fds`` and ``process_max_fds`` from a /metrics page (None where absent or unreadable)."""
    found: dict[str, float] = {}
    if not text:
        return None, None
    try:
        for family in text_string_to_metric_families(text):
            if family.name in ("process_open_fds", "process_max_fds") and family.samples:
                found[family.name] = float(family.samples[0].value)
    except (ValueError, TypeError, IndexError):
        return None, None
    return found.get("process_open_fds"), found.get("process_max_fds")


def _front(view: ClusterView, key: str, default: int) -> int:
    front = (view.gateway_config or {}).get("front")
    value = front.get(key) if isinstance(front, dict) else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def _pools(doc: Obj) -> list[Obj]:
    return [p for p in doc.get("pools") or [] if isinstance(p, dict)]


def tunnel_nodes(doc: Obj) -> int:
    """The nodes of tunnel pools a replica's /status counts (Prometheus reaches them through Raven)."""
    return sum(int(p.get("nodes") or 0) for p in _pools(doc) if p.get("reach", "tunnel") == "tunnel")


def need_of(view: ClusterView, doc: Obj, replicas: int, per_node: float, prometheus_replicas: int) -> Need:
    pools = _pools(doc)
    nodes = tunnel_nodes(doc)
    sessions = len({str(a.get("session")) for p in pools for a in p.get("agents") or []})
    conns = math.ceil(nodes * per_node * prometheus_replicas / max(1, replicas - 1))
    reserve = _front(view, "fd_reserve", GatewayFront.model_fields["fd_reserve"].default)
    return Need(conns, sessions, reserve, nodes, per_node, prometheus_replicas)


def descriptors(view: ClusterView, replicas: dict[str, ReplicaRead], per_node: float | None,
                prometheus_replicas: int) -> Result:
    docs = {url: r for url, r in replicas.items() if r.status is not None}
    if not docs:
        return failed(NAME, "no gateway /status to size the need from", "see ops-api above")
    count = max(len(docs), *(int(r.status.get("replicas") or 1) for r in docs.values() if r.status))
    per_node = per_node if per_node else 1.0
    max_conns = _front(view, "max_connections", GatewayFront.model_fields["max_connections"].default)
    bad, fixes, good = [], [], []
    for url, read in sorted(docs.items()):
        assert read.status is not None
        name = str(read.status.get("replica") or url)
        need = need_of(view, read.status, count, per_node, prometheus_replicas)
        used, limit = process_fds(read.metrics)
        if limit is None or used is None:
            bad.append(f"replica {name}: its /metrics has no process_max_fds (an older release, or not Linux)")
            fixes.append("upgrade the gateway (raven install --image ... | kubectl apply -f -)")
            continue
        if limit < need.total:
            bad.append(f"replica {name}: open-files limit {limit:.0f}, needs {need.total} ({need.explain()})")
            fixes.append(FIX.format(need=need.total))
        elif used > BUSY * limit:
            bad.append(f"replica {name}: {used:.0f} of {limit:.0f} descriptors open")
            fixes.append(FIX.format(need=max(need.total, int(2 * limit))))
        if need.front > max_conns:
            bad.append(f"replica {name}: front.max_connections {max_conns} is below the {need.front} Prometheus "
                       "connections it must hold")
            fixes.append(f"raise front.max_connections to at least {need.front} (the gateway's configuration; "
                         "raven install renders it)")
        good.append(f"{name} {used:.0f}/{limit:.0f} open, needs {need.total}")
    if bad:
        return failed(NAME, "; ".join(bad), "\n".join(dict.fromkeys(fixes)))
    return passed(NAME, "; ".join(good))
