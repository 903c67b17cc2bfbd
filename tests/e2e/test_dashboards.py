"""The Grafana dashboards (deploy/grafana/) and the prometheus-adapter rules (deploy/prometheus-adapter/) work
against a real Prometheus that scrapes a running Raven.

- the dashboard JSON is well formed: unique panel ids and uids, every panel has queries, every panel and query
  uses the ``${datasource}`` variable, every ``$variable`` a query uses is defined; the committed JSON is what
  deploy/grafana/generate.py produces, and the kustomization wraps each file in a ConfigMap that
  kube-prometheus-stack's Grafana sidecar loads (label ``grafana_dashboard: "1"``);
- EVERY panel query and every template-variable query runs, with the variables filled in the way Grafana
  fills them, against a real Prometheus (1 s scrapes) that scrapes simulated dcgm-exporters through a real
  gateway and real agents (HTTP SD from the gateway's /sd, proxy mode), plus the gateway's and the agents'
  own /metrics; a query fails the test if Prometheus returns an error, or no data where data must exist
  (ALLOWED_EMPTY lists the few panels that are legitimately empty on a healthy bed);
- every prometheus-adapter rule's ``metricsQuery``, templated as the adapter templates it, returns a value
  for every pod of a namespace.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from raven.aio import stop_process
from raven.demo.launch import LocalCluster, PoolSpec, free_port
from raven.demo.simexporter import SimExporter, SimNode
from tests.support import schemas
from tests.support.cluster import pick_node_port
from tests.support.paths import ROOT
from tests.support.polling import eventually

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_FILES = sorted((GRAFANA / "dashboards").glob("*.json"))
ADAPTER_VALUES = ROOT / "deploy" / "prometheus-adapter" / "values.yaml"
RULE_FILE = ROOT / "deploy" / "prometheus" / "rules" / "raven.rules.yaml"

HOSTS = ["127.0.70.2", "127.0.70.3", "127.0.70.4", "127.0.70.5"]
POOLS = ("edge-east", "edge-west")
BROKEN_NODE = "edge-west-2"  # its exporter answers 500: failing scrapes, so the error panels have data

# Grafana's built-in interval variables, as Grafana would fill them for a short time range and 1 s scrapes.
BUILTINS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}

# Values for the template variables, per dashboard uid: what a user would pick. A multi-value variable with
# several values is rendered by Grafana as a regex alternation in parentheses.
VARIABLES: dict[str, dict[str, str]] = {
    "raven-gpu-cluster": {"pool": f"({'|'.join(POOLS)})"},
    "raven-gpu-node": {"pool": "edge-east", "node": "edge-east-1"},
    "raven-tunnel": {"pool": f"({'|'.join(POOLS)})"},
}

# Panels that may legitimately show nothing on a healthy bed: (dashboard uid, panel title) -> why.
# Keep this small; every other panel must return data.
ALLOWED_EMPTY: dict[tuple[str, str], str] = {
    ("raven-tunnel", "Front-end refusals by reason"): "nothing is refused by a front-end limit here",
    ("raven-tunnel", "Registration refusals by pool and reason"): "every agent registers only its own pool's nodes",
    ("raven-tunnel", "Streams refused by agents"): "the gateway sends agents only allowed ports and known nodes",
    ("raven-tunnel", "Failovers: requests retried on another agent"): "no agent fails while the test runs",
    ("raven-gpu-cluster", "XID errors by GPU"): "the simulated GPUs never report an XID error",
}

pytestmark = pytest.mark.integration
aio = pytest.mark.asyncio(loop_scope="module")  # the async tests share the module's Prometheus and Raven


def load_dashboards() -> dict[str, dict[str, Any]]:
    boards: dict[str, dict[str, Any]] = {}
    for path in DASHBOARD_FILES:
        board = json.loads(path.read_text())
        boards[board["uid"]] = board
    return boards


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in board["panels"]:
        yield p
        yield from p.get("panels", [])  # panels inside a collapsed row


def query_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in panels(board) if p["type"] != "row"]


def fill(expr: str, variables: dict[str, str]) -> str:
    """Replace Grafana variables (``$name``, ``${name}``, built-ins) by values; fails on an unknown one."""
    for name, value in BUILTINS.items():
        expr = expr.replace(name, value)
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value)
        expr = re.sub(r"\$" + re.escape(name) + r"\b", value, expr)
    left = re.findall(r"\$\{?\w+", expr)
    assert not left, f"unknown variables {left} in {expr}"
    return expr


# ---------------------------------------------------------------- the JSON itself (no Prometheus needed)


def test_three_dashboards_exist() -> None:
    titles = {b["title"] for b in load_dashboards().values()}
    assert titles == {"GPU \u2013 cluster", "GPU \u2013 node", "Raven tunnel"}
    assert set(VARIABLES) == set(load_dashboards())


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    board = json.loads(path.read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    ds = variables.get("datasource")
    assert ds is not None and ds["type"] == "datasource" and ds["query"] == "prometheus"
    all_panels = list(panels(board))
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    for p in all_panels:
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
    for p in query_panels(board):
        where = f"{path.name}: panel {p['id']} {p['title']!r}"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["targets"], f"{where} has no queries"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{where}: duplicate refIds"
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert t["expr"].strip(), f"{where}: empty query"
            used = set(re.findall(r"\$\{?(\w+)", t["expr"])) - {"__rate_interval", "__interval", "__range"}
            assert used <= set(variables), f"{where}: undefined variables {used - set(variables)}"
            if "rate(" in t["expr"] or "increase(" in t["expr"]:
                assert "$__rate_interval" in t["expr"] or "$__range" in t["expr"], f"{where}: fixed rate window"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    # No datasource is named anywhere but through the variable.
    uids = set(re.findall(r'"uid": "([^"]*)"', path.read_text())) - {board["uid"]}
    assert uids == {"${datasource}"}, uids


def test_dashboards_are_generated() -> None:
    proc = subprocess.run([sys.executable, str(GRAFANA / "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_kustomization_makes_sidecar_configmaps() -> None:
    maps = schemas.render(GRAFANA)
    assert maps
    found: dict[str, Any] = {}
    for cm in maps:
        assert cm["kind"] == "ConfigMap"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        for key, text in cm["data"].items():
            assert key.endswith(".json")
            board = json.loads(text)
            found[board["uid"]] = board
    assert found == load_dashboards()


# ---------------------------------------------------------------- a real Prometheus scraping a real Raven


def prometheus_config(cluster: LocalCluster, node_port: int) -> dict[str, Any]:
    """The Prometheus configuration of the bed, in one place (credentials for the front end go here).

    Three jobs, as in production: the edge nodes through the gateway (proxy mode, targets from the gateway's
    HTTP SD, which attaches ``pool`` and ``node``), the gateway's own /metrics, and every agent's /metrics
    with its pool as the label ``pool`` (in Kubernetes a PodMonitor relabels it from the pod's labels).
    """
    agent_targets = [
        {"targets": [f"127.0.0.1:{cluster.agents[name].metrics_port}"], "labels": {"pool": pool.name}}
        for pool in cluster.pools for name in cluster.agent_names(pool)
    ]
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULE_FILE)],
        "scrape_configs": [
            {
                "job_name": "edge-dcgm",
                "proxy_url": cluster.front_url,
                "http_sd_configs": [{"url": f"{cluster.sd_url}?port={node_port}", "refresh_interval": "1s"}],
                "relabel_configs": [{"action": "labelkeep", "regex": "__.*|job|instance|node|pool"}],
            },
            {"job_name": "raven-gateway",
             "static_configs": [{"targets": [f"127.0.0.1:{cluster.gateway_metrics_port}"]}]},
            {"job_name": "raven-agent", "static_configs": agent_targets},
        ],
    }


@dataclass
class PromBed:
    cluster: LocalCluster
    exporter: SimExporter
    url: str


def write_config(work: Path, config: dict[str, Any]) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    path = work / "prometheus.yml"
    path.write_text(json.dumps(config))
    return path


async def start_prometheus(work: Path, config: dict[str, Any]) -> tuple[asyncio.subprocess.Process, str]:
    exe = shutil.which("prometheus")
    if exe is None:
        raise RuntimeError("prometheus is not installed (Debian package prometheus; scripts/system-deps.sh)")
    write_config(work, config)
    port = free_port()
    with (work / "prometheus.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            exe, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=log,
        )
    return proc, f"http://127.0.0.1:{port}"


async def stop(proc: asyncio.subprocess.Process) -> None:
    await stop_process(proc, signal.SIGTERM, 10)


NOT_YET = (OSError, aiohttp.ClientError, ValueError, KeyError, TimeoutError)
poll = functools.partial(eventually, timeout=40, interval=0.5, tolerate=NOT_YET)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prom(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PromBed]:
    workdir = tmp_path_factory.mktemp("raven-dashboards")
    port = pick_node_port(HOSTS)
    east = [SimNode("edge-east-1", HOSTS[0], port), SimNode("edge-east-2", HOSTS[1], port)]
    west = [SimNode("edge-west-1", HOSTS[2], port), SimNode(BROKEN_NODE, HOSTS[3], port)]
    exporter = SimExporter(east + west, refresh=1.0)  # values move every second: rates are not all 0
    cluster = LocalCluster(workdir, [PoolSpec("edge-east", east, agents=2), PoolSpec("edge-west", west, agents=1)],
                           allowed_ports=[port])
    proc: asyncio.subprocess.Process | None = None
    try:
        await exporter.start()
        exporter.set_mode(BROKEN_NODE, "error")
        await cluster.start()
        proc, url = await start_prometheus(workdir / "prometheus", prometheus_config(cluster, port))
        # A plain-HTTP request to the TLS tunnel port: one tunnel handshake failure for the dashboards.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            try:
                async with http.get(f"http://127.0.0.1:{cluster.tunnel_port}/tunnel") as resp:
                    await resp.read()
            except aiohttp.ClientError:
                pass
        yield PromBed(cluster, exporter, url)
    finally:
        if proc is not None:
            await stop(proc)
        await cluster.close()
        await exporter.close()


async def api(url: str, path: str, params: dict[str, str] | list[tuple[str, str]]) -> Any:
    """``data`` of a Prometheus API answer; a query error raises AssertionError with Prometheus's message."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(url + path, params=params) as resp:
            body = await resp.json()
    assert body.get("status") == "success", f"{path} {params}: {body.get('errorType')}: {body.get('error')}"
    return body["data"]


async def run_target(url: str, target: dict[str, Any], variables: dict[str, str]) -> list[dict[str, Any]]:
    expr = fill(target["expr"], variables)
    if target.get("instant"):
        data = await api(url, "/api/v1/query", {"query": expr})
    else:  # a timeseries panel: the range query Grafana sends
        now = time.time()
        data = await api(url, "/api/v1/query_range",
                         {"query": expr, "start": f"{now - 30:.3f}", "end": f"{now:.3f}", "step": "2"})
    result: list[dict[str, Any]] = data["result"]
    return result


async def wait_for_edge_data(url: str) -> None:
    async def ready() -> bool:
        data = await api(url, "/api/v1/query", {"query": 'count by (job) (up == 1) or count by (job) (up{node!=""})'})
        jobs = {r["metric"].get("job") for r in data["result"]}
        util = await api(url, "/api/v1/query", {"query": "count(DCGM_FI_DEV_GPU_UTIL)"})
        gpus = int(util["result"][0]["value"][1]) if util["result"] else 0
        return {"edge-dcgm", "raven-gateway", "raven-agent"} <= jobs and gpus == 8 * 3
    await poll(ready, what="Prometheus scrapes the gateway, the agents and 3 edge nodes (24 GPUs)")


@aio
async def test_every_panel_query_runs_and_has_data(prom: PromBed) -> None:
    await wait_for_edge_data(prom.url)
    boards = load_dashboards()
    missing: list[str] = []

    async def all_have_data() -> bool:
        missing.clear()
        for uid, board in boards.items():
            for p in query_panels(board):
                for t in p["targets"]:
                    result = await run_target(prom.url, t, VARIABLES[uid])  # a query error fails at once
                    if not result and (uid, p["title"]) not in ALLOWED_EMPTY:
                        missing.append(f"{uid}: {p['title']!r} {t['refId']}: {fill(t['expr'], VARIABLES[uid])}")
        return not missing

    try:
        await poll(all_have_data, what="every panel has data")  # rates and quantiles need a few scrapes
    except AssertionError:
        pytest.fail("panels without data:\n" + "\n".join(missing))
    # The allow-list names panels that exist.
    titles = {(uid, p["title"]) for uid, b in boards.items() for p in query_panels(b)}
    assert set(ALLOWED_EMPTY) <= titles, set(ALLOWED_EMPTY) - titles


@aio
async def test_panels_show_the_bed(prom: PromBed) -> None:
    """A few panels checked for the right numbers, not only for some data."""
    await wait_for_edge_data(prom.url)
    boards = load_dashboards()

    def target_of(uid: str, title: str) -> dict[str, Any]:
        [p] = [p for p in query_panels(boards[uid]) if p["title"] == title]
        t: dict[str, Any] = p["targets"][0]
        return t

    async def value_by(uid: str, title: str, label: str) -> dict[str, float]:
        expr = fill(target_of(uid, title)["expr"], VARIABLES[uid])
        data = await api(prom.url, "/api/v1/query", {"query": expr})
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in data["result"]}

    async def as_expected() -> bool:
        gpus = await value_by("raven-gpu-cluster", "GPUs", "pool")
        agents = await value_by("raven-tunnel", "Agents per pool", "pool")
        failing = await value_by("raven-tunnel", "Edge targets failing", "pool")
        per_gpu = await value_by("raven-gpu-node", "GPU utilisation", "gpu")
        return (gpus == {"edge-east": 16, "edge-west": 8} and agents == {"edge-east": 2, "edge-west": 1}
                and failing == {"edge-east": 0, "edge-west": 1} and sorted(per_gpu) == [str(i) for i in range(8)])

    await poll(as_expected, what="the panels show 3+1 nodes, 2+1 agents and 1 failing node")


@aio
async def test_every_variable_query_returns_values(prom: PromBed) -> None:
    await wait_for_edge_data(prom.url)
    for uid, board in load_dashboards().items():
        for v in board["templating"]["list"]:
            if v["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
            assert match, f"{uid}: variable {v['name']}: expected label_values(selector, label)"
            selector = fill(match.group(1), VARIABLES[uid])
            data = await api(prom.url, "/api/v1/label/" + match.group(2) + "/values", [("match[]", selector)])
            assert VARIABLES[uid][v["name"]].strip("()").split("|")[0] in data, (uid, v["name"], data)


# ---------------------------------------------------------------- the rules on real series


@aio
async def test_recording_rules_and_alerts_on_real_series(prom: PromBed) -> None:
    """Raven's rules loaded into the bed's Prometheus: every recording rule yields data from the real series
    (so the labels they rely on exist), and the broken node's failing scrapes make its alert pending."""
    await wait_for_edge_data(prom.url)
    records = [r["record"] for g in yaml.safe_load(RULE_FILE.read_text())["groups"] for r in g["rules"]
               if "record" in r]
    empty: list[str] = []

    async def recorded() -> bool:
        empty[:] = [r for r in records if not (await api(prom.url, "/api/v1/query", {"query": r}))["result"]]
        return not empty

    try:
        await poll(recorded, what="every recording rule has data")
    except AssertionError:
        pytest.fail(f"recording rules without data: {empty}")
    by_pool: dict[str, float] = {}

    async def error_ratios() -> bool:  # edge-west: 1 node of 2 answers 500; edge-east: no errors, 0 not absent
        ratio = await api(prom.url, "/api/v1/query", {"query": "pool:raven_gateway_request_errors:ratio_rate5m"})
        by_pool.clear()
        by_pool.update({r["metric"]["pool"]: float(r["value"][1]) for r in ratio["result"]})
        return by_pool.get("edge-east") == 0 and 0.2 < by_pool.get("edge-west", 0) < 0.8

    try:
        await poll(error_ratios, what="error ratios per pool")
    except AssertionError:
        pytest.fail(f"pool:raven_gateway_request_errors:ratio_rate5m: {by_pool}")

    async def pending() -> bool:
        alerts = (await api(prom.url, "/api/v1/alerts", {}))["alerts"]
        failing = {(a["labels"]["alertname"], a["labels"].get("node")) for a in alerts}
        return ("RavenNodeScrapeFailing", BROKEN_NODE) in failing and not any(
            name == "RavenNodeScrapeFailing" and node != BROKEN_NODE for name, node in failing)

    await poll(pending, what=f"RavenNodeScrapeFailing pending for {BROKEN_NODE} only")


# ---------------------------------------------------------------- prometheus-adapter


def adapter_rules() -> list[dict[str, Any]]:
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    rules: list[dict[str, Any]] = values["rules"]["custom"]
    return rules


def adapter_query(rule: dict[str, Any], series: str, matchers: str, group_by: str) -> str:
    template: str = rule["metricsQuery"]
    return (template.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
            .replace("<<.GroupBy>>", group_by))


def test_adapter_rules_are_well_formed() -> None:
    names = set()
    for rule in adapter_rules():
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        for token in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert token in rule["metricsQuery"], (rule["name"], token)
        names.add(rule["name"]["as"])
    assert len(names) == len(adapter_rules())
    hpa = yaml.safe_load((ADAPTER_VALUES.parent / "hpa-example.yaml").read_text())
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= names


@aio
@pytest.mark.parametrize("rule", adapter_rules(), ids=lambda r: r["name"]["as"])
async def test_adapter_metrics_query_gives_per_pod_values(prom: PromBed, rule: dict[str, Any]) -> None:
    """As the adapter does for ``GET .../namespaces/<ns>/pods/*/<metric>``: the series from seriesQuery, the
    metric name renamed by ``name``, then metricsQuery with LabelMatchers = the namespace and the pods, GroupBy =
    the pod label. Every pod of the namespace must get a value."""
    await wait_for_edge_data(prom.url)
    found = await api(prom.url, "/api/v1/series", [("match[]", rule["seriesQuery"])])
    assert found, f"seriesQuery {rule['seriesQuery']} finds nothing"
    [series] = {s["__name__"] for s in found}
    assert re.sub(rule["name"]["matches"], rule["name"]["as"], series) == rule["name"]["as"]
    pods_by_ns: dict[str, set[str]] = {}
    for s in found:
        pods_by_ns.setdefault(s["namespace"], set()).add(s["pod"])
    for namespace, pods in sorted(pods_by_ns.items()):
        matchers = f'namespace="{namespace}",pod=~"{"|".join(sorted(pods))}"'
        query = adapter_query(rule, series, matchers, "pod")
        result = (await api(prom.url, "/api/v1/query", {"query": query}))["result"]
        got = {r["metric"].get("pod"): float(r["value"][1]) for r in result}
        assert set(got) == pods, f"{query}: pods {sorted(got)}, expected {sorted(pods)}"
        assert all(v >= 0 for v in got.values()), got
        assert any(v > 0 for v in got.values()), got
    # The namespace resource (GET .../namespaces/*/metrics/<metric>): one value per namespace.
    query = adapter_query(rule, series, f'namespace=~"{"|".join(sorted(pods_by_ns))}"', "namespace")
    result = (await api(prom.url, "/api/v1/query", {"query": query}))["result"]
    assert {r["metric"].get("namespace") for r in result} == set(pods_by_ns)
