"""Generate Raven's Grafana dashboards (deploy/grafana/dashboards/*.json) from one place.

    python deploy/grafana/generate.py            # rewrite the JSON files
    python deploy/grafana/generate.py --check    # exit 1 if a committed file differs (tests run this)

The JSON files are what gets installed (kustomize puts each in a ConfigMap labelled grafana_dashboard: "1",
which kube-prometheus-stack's Grafana sidecar loads). Edit this file, not the JSON, then regenerate.

Conventions: every panel and query uses the datasource variable ``${datasource}``; edge series carry the
``pool`` and ``node`` labels that the scrape job copies from Raven's HTTP service discovery; Raven's agent
series carry ``pool`` from the agent's scrape job (see README.md); rates use ``$__rate_interval``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"
DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"

Json = dict[str, Any]


# ---------------------------------------------------------------- building blocks


def target(expr: str, legend: str = "", *, instant: bool = False, ref: str = "A") -> Json:
    t: Json = {"datasource": DS, "expr": expr, "refId": ref, "legendFormat": legend or "__auto", "range": not instant,
               "instant": instant}
    if instant:
        t["format"] = "table"
    return t


def panel(kind: str, title: str, targets: list[Json], *, w: int = 12, h: int = 8, unit: str = "short",
          description: str = "", options: Json | None = None, decimals: int | None = None,
          max_value: float | None = None, stack: bool = False) -> Json:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    defaults: Json = {"unit": unit}
    if decimals is not None:
        defaults["decimals"] = decimals
    if max_value is not None:
        defaults["max"] = max_value
        defaults["min"] = 0
    if kind == "timeseries":
        defaults["custom"] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    p: Json = {"type": kind, "title": title, "description": description, "datasource": DS, "targets": targets,
               "fieldConfig": {"defaults": defaults, "overrides": []}, "gridPos": {"w": w, "h": h},
               "options": options or {}}
    if kind == "timeseries" and not options:
        p["options"] = {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}
    if kind == "stat" and not options:
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "value_and_name"}
    return p


def table(title: str, targets: list[Json], *, w: int = 12, h: int = 8, unit: str = "short",
          description: str = "", sort_by: str = "Value") -> Json:
    p = panel("table", title, targets, w=w, h=h, unit=unit, description=description,
              options={"showHeader": True, "sortBy": [{"displayName": sort_by, "desc": True}]})
    p["transformations"] = [{"id": "merge", "options": {}},
                            {"id": "organize", "options": {"excludeByName": {"Time": True}}}]
    return p


def row(title: str) -> Json:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def datasource_var() -> Json:
    return {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
            "current": {}, "hide": 0, "regex": "", "refresh": 1, "includeAll": False, "multi": False, "options": []}


def query_var(name: str, label: str, query: str, *, multi: bool, all_value: str | None = ".+") -> Json:
    v: Json = {"type": "query", "name": name, "label": label, "datasource": DS, "definition": query,
               "query": {"query": query, "refId": f"{name}-query", "qryType": 1},
               "refresh": 2, "sort": 1, "multi": multi, "includeAll": multi, "current": {}, "hide": 0,
               "options": [], "regex": ""}
    if multi and all_value is not None:
        v["allValue"] = all_value
    return v


def layout(panels: list[Json]) -> list[Json]:
    """Give every panel an id and a position: left to right, wrapping at 24 columns; rows span the width."""
    x = y = row_h = 0
    for pid, p in enumerate(panels, 1):
        p["id"] = pid
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24 or p["type"] == "row":
            x, y, row_h = 0, y + row_h, 0
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        x += w
        row_h = max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return panels


def dashboard(uid: str, title: str, description: str, variables: list[Json], panels: list[Json]) -> Json:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["raven", "gpu", "edge"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"}, "timepicker": {}, "timezone": "browser",
        "annotations": {"list": []}, "links": [
            {"type": "dashboards", "tags": ["raven"], "title": "Raven", "asDropdown": True, "includeVars": False,
             "keepTime": True}],
        "templating": {"list": [datasource_var(), *variables]},
        "panels": layout(panels),
    }


# ---------------------------------------------------------------- GPU - cluster

P = 'pool=~"$pool"'


def gpu_cluster() -> Json:
    variables = [query_var("pool", "Pool", 'label_values(DCGM_FI_DEV_GPU_UTIL{pool!=""}, pool)', multi=True)]
    panels = [
        row("Overview"),
        panel("stat", "GPUs", [target(f"count by (pool) (DCGM_FI_DEV_GPU_UTIL{{{P}}})", "{{pool}}")], w=4, h=4,
              description="GPUs reporting through the tunnel, per pool."),
        panel("stat", "Nodes reporting", [target(
            f"count by (pool) (count by (pool, node) (DCGM_FI_DEV_GPU_UTIL{{{P}}}))", "{{pool}}")], w=4, h=4),
        panel("stat", "Mean GPU utilisation", [target(f"avg by (pool) (DCGM_FI_DEV_GPU_UTIL{{{P}}})", "{{pool}}")],
              unit="percent", max_value=100, w=4, h=4),
        panel("stat", "Framebuffer used", [target(
            f"sum by (pool) (DCGM_FI_DEV_FB_USED{{{P}}}) / (sum by (pool) (DCGM_FI_DEV_FB_USED{{{P}}})"
            f" + sum by (pool) (DCGM_FI_DEV_FB_FREE{{{P}}}))", "{{pool}}")], unit="percentunit", max_value=1, w=4, h=4),
        panel("stat", "Power", [target(f"sum by (pool) (DCGM_FI_DEV_POWER_USAGE{{{P}}})", "{{pool}}")],
              unit="watt", w=4, h=4),
        panel("stat", "GPUs with an XID error", [target(
            f"count by (pool) (max_over_time(DCGM_FI_DEV_XID_ERRORS{{{P}}}[$__range]) != 0)"
            f" or on (pool) (0 * count by (pool) (DCGM_FI_DEV_XID_ERRORS{{{P}}}))", "{{pool}}")], w=4, h=4,
              description="GPUs whose last XID error (DCGM_FI_DEV_XID_ERRORS) was non-zero at some point in the "
                          "time range; 0 when none."),
        row("Utilisation and memory"),
        panel("timeseries", "GPU utilisation by pool", [
            target(f"avg by (pool) (DCGM_FI_DEV_GPU_UTIL{{{P}}})", "{{pool}} mean"),
            target(f"max by (pool) (DCGM_FI_DEV_GPU_UTIL{{{P}}})", "{{pool}} max"),
        ], unit="percent", max_value=100),
        panel("timeseries", "Tensor core activity by pool", [
            target(f"avg by (pool) (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{P}}})", "{{pool}}")],
            unit="percentunit", max_value=1),
        panel("timeseries", "Framebuffer used and free by pool", [
            target(f"sum by (pool) (DCGM_FI_DEV_FB_USED{{{P}}})", "{{pool}} used"),
            target(f"sum by (pool) (DCGM_FI_DEV_FB_FREE{{{P}}})", "{{pool}} free"),
        ], unit="mbytes", description="DCGM reports framebuffer memory in MiB."),
        panel("timeseries", "GPU utilisation by node", [
            target(f"avg by (pool, node) (DCGM_FI_DEV_GPU_UTIL{{{P}}})", "{{node}}")], unit="percent",
            max_value=100),
        row("Temperature, power, errors"),
        panel("timeseries", "GPU temperature by pool", [
            target(f"max by (pool) (DCGM_FI_DEV_GPU_TEMP{{{P}}})", "{{pool}} max"),
            target(f"avg by (pool) (DCGM_FI_DEV_GPU_TEMP{{{P}}})", "{{pool}} mean"),
            target(f"max by (pool) (DCGM_FI_DEV_MEMORY_TEMP{{{P}}})", "{{pool}} memory max"),
        ], unit="celsius", w=8),
        panel("timeseries", "Power draw by pool", [
            target(f"sum by (pool) (DCGM_FI_DEV_POWER_USAGE{{{P}}})", "{{pool}}")], unit="watt", w=8, stack=True),
        panel("timeseries", "Energy by pool", [
            target(f"sum by (pool) (rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{P}}}[{RATE}])) / 1000", "{{pool}}")],
            unit="watt", w=8, description="Rate of DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ) in watts."),
        table("XID errors by GPU", [target(
            f"max by (pool, node, gpu, UUID) (max_over_time(DCGM_FI_DEV_XID_ERRORS{{{P}}}[$__range]) != 0)",
            instant=True)], w=24, h=6,
            description="GPUs whose last XID error code was non-zero in the time range (the value is the XID). "
                        "Empty when all is well."),
        row("Pods"),
        table("Top pods by GPU memory (GPUs allocated to the pod)", [target(
            f'topk(15, sum by (pool, namespace, pod) (DCGM_FI_DEV_FB_USED{{{P}, pod!=""}}))', instant=True)],
            unit="mbytes", description="Framebuffer used on the GPUs that Kubernetes allocated to each pod "
                                       "(dcgm-exporter's pod/namespace attribution)."),
        table("Top pods by GPU memory (all processes, GPU sharing)", [target(
            f"topk(15, sum by (pool, namespace, pod) (DCGM_CUSTOM_PROCESS_MEM_USED{{{P}}}))", instant=True)],
            unit="mbytes", description="Per-process series summed per pod: counts pods that share a GPU "
                                       "(time-slicing, MPS) and do not own it."),
        panel("timeseries", "SM utilisation by pod (GPU sharing)", [target(
            f"topk(10, sum by (namespace, pod) (DCGM_CUSTOM_PROCESS_SM_UTIL{{{P}}}))", "{{namespace}}/{{pod}}")],
            unit="percent"),
        table("Pods per GPU (GPU sharing)", [target(
            f"count by (pool, node, gpu) (count by (pool, node, gpu, namespace, pod) "
            f"(DCGM_CUSTOM_PROCESS_MEM_USED{{{P}}}))", instant=True)],
            description="How many pods have processes on each GPU; more than 1 means the GPU is shared."),
    ]
    return dashboard("raven-gpu-cluster", "GPU \u2013 cluster",
                     "Edge GPUs per pool, scraped through the Raven tunnel (dcgm-exporter series).",
                     variables, panels)


# ---------------------------------------------------------------- GPU - node

N = 'node="$node"'


def gpu_node() -> Json:
    variables = [
        query_var("pool", "Pool", 'label_values(DCGM_FI_DEV_GPU_UTIL{pool!=""}, pool)', multi=False),
        query_var("node", "Node", 'label_values(DCGM_FI_DEV_GPU_UTIL{pool=~"$pool"}, node)', multi=False),
    ]
    per_gpu = "GPU {{gpu}}"
    panels = [
        row("Node"),
        panel("stat", "GPUs", [target(f"count(DCGM_FI_DEV_GPU_UTIL{{{N}}})", "GPUs")], w=6, h=4),
        panel("stat", "Scrape through the tunnel", [target(f'up{{{N}, pool!=""}}', "{{job}}")], w=6, h=4,
              description="1: the last scrape of this node through Raven succeeded."),
        panel("stat", "Scrape duration", [target(f'scrape_duration_seconds{{{N}, pool!=""}}', "{{job}}")],
              unit="s", w=6, h=4),
        table("Model and driver", [target(
            f"count by (modelName, DCGM_FI_DRIVER_VERSION) (DCGM_FI_DEV_GPU_UTIL{{{N}}})", instant=True)],
            w=6, h=4),
        row("Per GPU"),
        panel("timeseries", "GPU utilisation", [target(f"DCGM_FI_DEV_GPU_UTIL{{{N}}}", per_gpu)],
              unit="percent", max_value=100, w=8),
        panel("timeseries", "Memory copy utilisation", [target(f"DCGM_FI_DEV_MEM_COPY_UTIL{{{N}}}", per_gpu)],
              unit="percent", max_value=100, w=8),
        panel("timeseries", "Tensor core activity", [target(f"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{N}}}", per_gpu)],
              unit="percentunit", max_value=1, w=8),
        panel("timeseries", "Framebuffer used", [target(f"DCGM_FI_DEV_FB_USED{{{N}}}", per_gpu)],
              unit="mbytes", w=8),
        panel("timeseries", "Framebuffer free", [target(f"DCGM_FI_DEV_FB_FREE{{{N}}}", per_gpu)],
              unit="mbytes", w=8),
        panel("timeseries", "SM clock", [target(f"DCGM_FI_DEV_SM_CLOCK{{{N}}}", per_gpu)], unit="hertz", w=8),
        panel("timeseries", "GPU temperature", [target(f"DCGM_FI_DEV_GPU_TEMP{{{N}}}", per_gpu)],
              unit="celsius", w=8),
        panel("timeseries", "Memory temperature", [target(f"DCGM_FI_DEV_MEMORY_TEMP{{{N}}}", per_gpu)],
              unit="celsius", w=8),
        panel("timeseries", "Power draw", [target(f"DCGM_FI_DEV_POWER_USAGE{{{N}}}", per_gpu)], unit="watt", w=8),
        panel("timeseries", "Last XID error", [target(f"DCGM_FI_DEV_XID_ERRORS{{{N}}}", per_gpu)], w=8,
              description="The code of the last XID error per GPU (0: none)."),
        panel("timeseries", "Energy", [target(
            f"rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{N}}}[{RATE}]) / 1000", per_gpu)], unit="watt", w=8),
        panel("timeseries", "Graphics engine active", [target(f"DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{N}}}", per_gpu)],
              unit="percentunit", max_value=1, w=8),
        row("Pods on this node"),
        table("GPUs allocated to pods", [target(
            f'max by (gpu, namespace, pod, container) (DCGM_FI_DEV_FB_USED{{{N}, pod!=""}})', instant=True)],
            unit="mbytes"),
        table("Processes by pod (GPU sharing)", [target(
            f"sum by (gpu, namespace, pod, container) (DCGM_CUSTOM_PROCESS_MEM_USED{{{N}}})", instant=True)],
            unit="mbytes"),
    ]
    return dashboard("raven-gpu-node", "GPU \u2013 node",
                     "One edge node, per GPU (dcgm-exporter series through Raven).",
                     variables, panels)


# ---------------------------------------------------------------- Raven tunnel


def raven_tunnel() -> Json:
    variables = [query_var("pool", "Pool", "label_values(raven_gateway_sessions, pool)", multi=True)]
    panels = [
        row("Agents and sessions"),
        panel("stat", "Agents per pool", [target(f"max by (pool) (raven_gateway_sessions{{{P}}})", "{{pool}}")],
              w=6, h=4,
              description="Agent sessions of the pool on the best-connected gateway replica (each agent holds "
                          "one session to every replica). 0: the pool is unreachable."),
        panel("stat", "Nodes reachable per pool", [target(f"max by (pool) (raven_gateway_nodes{{{P}}})",
                                                         "{{pool}}")], w=6, h=4),
        panel("stat", "Gateway replicas", [target("count(raven_gateway_streams_in_flight)", "replicas")], w=6, h=4),
        panel("stat", "Edge targets failing", [target(
            f'count by (pool) (up{{{P}, node!=""}} == 0) or on (pool) (0 * count by (pool) (up{{{P}, node!=""}}))',
            "{{pool}}")], w=6, h=4, description="Nodes whose last scrape through the tunnel failed."),
        panel("timeseries", "Sessions per gateway replica and pool", [target(
            f"sum by (instance, pool) (raven_gateway_sessions{{{P}}})", "{{instance}} {{pool}}")], w=8),
        panel("timeseries", "Sessions held by each agent", [target(
            f"raven_agent_sessions{{{P}}}", "{{pool}} {{instance}}")], w=8,
            description="Gateway replicas each agent is connected to."),
        panel("timeseries", "Agent dial attempts by result", [target(
            f"sum by (pool, result) (rate(raven_agent_connect_attempts_total{{{P}}}[{RATE}]))",
            "{{pool}} {{result}}")], unit="ops", w=8,
            description="ok more often than rarely: agents are flapping (sessions drop and come back)."),
        row("Scrapes through the tunnel"),
        panel("timeseries", "Requests per pool by code (gateway)", [target(
            f"sum by (pool, code) (rate(raven_gateway_requests_total{{{P}}}[{RATE}]))", "{{pool}} {{code}}")],
            unit="reqps", w=8),
        panel("timeseries", "Failed requests per pool (gateway)", [target(
            f'sum by (pool, code) (rate(raven_gateway_requests_total{{{P}, code!~"2..|3.."}}[{RATE}]))',
            "{{pool}} {{code}}")], unit="reqps", w=8,
            description="Everything but 2xx/3xx: edge errors, refusals (4xx/5xx), broken bodies, clients gone."),
        panel("timeseries", "Latency per pool (gateway, p50 / p99)", [
            target(f"histogram_quantile(0.5, sum by (pool, le) "
                   f"(rate(raven_gateway_request_duration_seconds_bucket{{{P}}}[{RATE}])))", "{{pool}} p50"),
            target(f"histogram_quantile(0.99, sum by (pool, le) "
                   f"(rate(raven_gateway_request_duration_seconds_bucket{{{P}}}[{RATE}])))", "{{pool}} p99"),
        ], unit="s", w=8),
        panel("timeseries", "Requests per pool by code (agent)", [target(
            f"sum by (pool, code) (rate(raven_agent_requests_total{{{P}}}[{RATE}]))", "{{pool}} {{code}}")],
            unit="reqps", w=8,
            description="The agents' own count, per pool (agents keep no per-node series; per node, see the "
                        "scrape duration and failing nodes below, and the last error of each node in raven status)."),
        panel("timeseries", "Latency per pool (agent to node, p50 / p99)", [
            target(f"histogram_quantile(0.5, sum by (pool, le) "
                   f"(rate(raven_agent_upstream_duration_seconds_bucket{{{P}}}[{RATE}])))", "{{pool}} p50"),
            target(f"histogram_quantile(0.99, sum by (pool, le) "
                   f"(rate(raven_agent_upstream_duration_seconds_bucket{{{P}}}[{RATE}])))", "{{pool}} p99"),
        ], unit="s", w=8),
        panel("timeseries", "Scrape duration per node (Prometheus)", [target(
            f'scrape_duration_seconds{{{P}, node!=""}}', "{{node}} {{job}}")], unit="s", w=8),
        table("Nodes failing scrapes", [target(f'up{{{P}, node!=""}} == 0', instant=True)], w=24, h=5,
              description="Edge targets whose last scrape through the tunnel failed (see the gateway's X-Raven-Error "
                          "header in Prometheus's target page for why)."),
        row("Refusals, failovers, bytes"),
        panel("timeseries", "Front-end refusals by reason", [target(
            f"sum by (reason) (rate(raven_gateway_front_refused_total[{RATE}]))", "{{reason}}")], unit="reqps", w=8),
        panel("timeseries", "Registration refusals by pool and reason", [target(
            f"sum by (pool, reason) (rate(raven_gateway_registration_refusals_total[{RATE}]))",
            "{{pool}} {{reason}}")], unit="ops", w=8),
        panel("timeseries", "Tunnel handshake failures by reason", [target(
            f"sum by (reason) (rate(raven_gateway_handshake_failures_total[{RATE}]))", "{{reason}}")], unit="ops",
            w=8),
        panel("timeseries", "Streams refused by agents", [target(
            f"sum by (pool, reason) (rate(raven_agent_refused_streams_total{{{P}}}[{RATE}]))",
            "{{pool}} {{reason}}")], unit="ops", w=8),
        panel("timeseries", "Failovers: requests retried on another agent", [target(
            f"sum by (pool) (rate(raven_gateway_retries_total{{{P}}}[{RATE}]))", "{{pool}}")], unit="reqps", w=8),
        panel("timeseries", "Streams in flight", [
            target("sum by (instance) (raven_gateway_streams_in_flight)", "gateway {{instance}}"),
            target(f"sum by (pool) (raven_agent_streams_in_flight{{{P}}})", "agents {{pool}}"),
        ], w=8),
        panel("timeseries", "Bytes through the gateway by pool", [target(
            f"sum by (pool, direction) (rate(raven_gateway_bytes_total{{{P}}}[{RATE}]))", "{{pool}} {{direction}}")],
            unit="Bps", w=12),
        panel("timeseries", "Agent connections to nodes (open, idle, cap)", [
            target(f"sum by (pool) (raven_agent_upstream_connections{{{P}}})", "open {{pool}}"),
            target(f"sum by (pool) (raven_agent_upstream_connections_idle{{{P}}})", "idle {{pool}}"),
            target(f"max by (pool) (raven_agent_upstream_connections_limit{{{P}}})", "cap per agent {{pool}}"),
        ], w=12, description="Keep-alive connections from the agents to their nodes; at the cap, idle ones are "
                             "recycled and requests wait (raven_agent_upstream_cap_waits_total)."),
        panel("timeseries", "Longest garbage-collector pause", [
            target("max by (job, instance) (raven_gc_pause_max_seconds)", "{{job}} {{instance}}"),
        ], unit="s", w=12, description="Per process, since it started: a pause stalls every stream of that process."),
        panel("timeseries", "Bytes through the agents by pool", [target(
            f"sum by (pool, direction) (rate(raven_agent_bytes_total{{{P}}}[{RATE}]))", "{{pool}} {{direction}}")],
            unit="Bps", w=12),
    ]
    return dashboard("raven-tunnel", "Raven tunnel",
                     "Raven gateway and agents: sessions, scrapes through the tunnel, refusals, failovers, bytes.",
                     variables, panels)


DASHBOARDS = {"gpu-cluster.json": gpu_cluster, "gpu-node.json": gpu_node, "raven-tunnel.json": raven_tunnel}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n" for name, build in DASHBOARDS.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed dashboard differs")
    args = parser.parse_args()
    stale = []
    for name, text in render().items():
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}: run python deploy/grafana/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
