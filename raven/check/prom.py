"""The Prometheus check of ``raven check``: Prometheus scrapes the edge job (``edge-dcgm``, or ``edge-dcgm-proxy``
in proxy mode: deploy/prometheus/scrape-config.yaml, or the Operator's ScrapeConfig raven-edge-dcgm) and ``up``
is 1 for a sample of edge nodes.

Prometheus is asked through its HTTP API (``/api/v1/query``; raven/ops/client.py, bounded), at ``--prometheus``
or at the Operator's governing Service (the one labelled ``operated-prometheus=true``, port 9090, reachable from
inside the cluster). Every query's answer is small whatever the fleet's size (counts, and the sample's series).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from raven.check.reader import OPERATED_PROMETHEUS, Obj, ReplicaRead
from raven.check.results import Result, failed, passed
from raven.ops import client as ops_client
from raven.protocol.wire import valid_node_name

NAME = "prometheus"
EDGE_JOBS = r"edge-dcgm|edge-dcgm-proxy"
SAMPLE = 5
MAX_ANSWER = 1 << 20

SCRAPE_FIX = ("Operator: kubectl -n kube-system get scrapeconfig raven-edge-dcgm (raven install --monitoring operator "
              "makes it), and its label release: must be your kube-prometheus-stack release's (kubectl get prometheus "
              "-A -o yaml | grep -A3 scrapeConfigSelector); plain Prometheus: add the jobs of "
              "deploy/prometheus/scrape-config.yaml (raven install --monitoring prometheus)")


@dataclass
class PromRead:
    url: str
    error: str = ""
    jobs: dict[str, int] = field(default_factory=dict)  # edge job -> targets
    down: int = 0  # edge targets with up == 0
    sample: dict[str, float | None] = field(default_factory=dict)  # node -> up (None: no such target)

    def targets_per_node(self, nodes: int) -> float | None:
        """Edge targets per tunnel node (exporters scraped through Raven), for the descriptor check."""
        total = sum(self.jobs.values())
        return total / nodes if total and nodes else None


def service_url(services: list[Obj]) -> str | None:
    """The Operator's governing Service (prometheus-operated) as a URL reachable in the cluster."""
    for svc in sorted(services, key=lambda s: (s["metadata"].get("namespace", ""), s["metadata"]["name"])):
        meta = svc["metadata"]
        ports = [p for p in (svc.get("spec") or {}).get("ports") or [] if p.get("name") == "web"]
        port = int(ports[0].get("port") or 9090) if ports else 9090
        return f"http://{meta['name']}.{meta.get('namespace', 'default')}.svc:{port}"
    return None


def sample_nodes(replicas: dict[str, ReplicaRead], fallback: list[str]) -> list[str]:
    """Up to SAMPLE tunnel nodes: the gateways' status pages list those that need attention first."""
    names: list[str] = []
    for read in replicas.values():
        for row in (read.status or {}).get("nodes") or []:
            if row.get("reach", "tunnel") == "tunnel" and isinstance(row.get("name"), str):
                names.append(row["name"])
    names = sorted(dict.fromkeys(n for n in names if valid_node_name(n)))[:SAMPLE]
    return names or [n for n in fallback if valid_node_name(n)][:SAMPLE]


async def _query(url: str, promql: str, timeout: float) -> list[dict[str, Any]]:
    reply = await ops_client.get(url.rstrip("/") + "/api/v1/query", None, timeout, MAX_ANSWER, {"query": promql})
    doc = reply.json()
    if not isinstance(doc, dict) or doc.get("status") != "success":
        error = doc.get("error") if isinstance(doc, dict) else None
        raise ops_client.OpsReadError(f"{url} did not answer the query {promql!r}: {str(error)[:200]}")
    result = (doc.get("data") or {}).get("result")
    return [r for r in result if isinstance(r, dict)] if isinstance(result, list) else []


def _value(series: dict[str, Any]) -> float:
    try:
        return float(series["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return float("nan")


async def read_prometheus(url: str, nodes: list[str], timeout: float) -> PromRead:
    out = PromRead(url)
    try:
        for s in await _query(url, f'count by (job) (up{{job=~"{EDGE_JOBS}"}})', timeout):
            out.jobs[str((s.get("metric") or {}).get("job"))] = int(_value(s))
        for s in await _query(url, f'count(up{{job=~"{EDGE_JOBS}"}} == 0)', timeout):
            out.down = int(_value(s))
        if nodes and out.jobs:
            names = "|".join(re.escape(n).replace("\\", "\\\\") for n in nodes)
            out.sample = dict.fromkeys(nodes)
            for s in await _query(url, f'up{{job=~"{EDGE_JOBS}", node=~"{names}"}}', timeout):
                node = (s.get("metric") or {}).get("node")
                if node in out.sample:
                    value = _value(s)
                    prev = out.sample[node]
                    out.sample[node] = value if prev is None else min(prev, value)
    except ops_client.OpsReadError as exc:
        out.error = str(exc)
    return out


def prometheus(read: PromRead | None) -> Result:
    if read is None:
        return failed(NAME, "no Prometheus to ask: no --prometheus, and no Service labelled "
                      f"{OPERATED_PROMETHEUS} (the Operator's prometheus-operated)",
                      "pass --prometheus http://localhost:9090 after kubectl -n NAMESPACE port-forward "
                      "svc/prometheus-operated 9090 (or your Prometheus's address)")
    if read.error:
        return failed(NAME, read.error, "run raven check in a pod, or pass --prometheus http://localhost:9090 after "
                      "kubectl -n NAMESPACE port-forward svc/prometheus-operated 9090")
    if not read.jobs:
        return failed(NAME, f"Prometheus at {read.url} has no target in job edge-dcgm (nor edge-dcgm-proxy)",
                      SCRAPE_FIX)
    jobs = ", ".join(f"{job} {n} targets" for job, n in sorted(read.jobs.items()))
    missing = sorted(n for n, v in read.sample.items() if v is None)
    down = sorted(n for n, v in read.sample.items() if v is not None and v != 1)
    if missing or down:
        parts = ([f"up is 0 for {', '.join(down)}"] if down else []) + (
            [f"no edge target for {', '.join(missing)}"] if missing else [])
        first = (down or missing)[0]
        return failed(NAME, f"{jobs}; {'; '.join(parts)}",
                      f"raven status --gateway http://GATEWAY:10265 --token-file FILE --node {first} (the gateway's "
                      f"latest scrape of it and why); Prometheus's {read.url}/targets says the scrape error"
                      + ("; a node with no target: its pool's agents do not serve it (see agents above)"
                         if missing else ""))
    sample = f"; up is 1 for {', '.join(sorted(read.sample))}" if read.sample else ""
    also = f"; {read.down} edge targets down now" if read.down else ""
    return passed(NAME, f"{read.url}: {jobs}{sample}{also}")
