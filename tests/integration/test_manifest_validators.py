"""The validators can fail, and the monitoring objects (deploy/monitoring/) fit what they watch.

Each validator of tests/support/schemas.py is shown a rendered object with one field broken on purpose (an unknown
field, a wrong type, a value outside an enum or a pattern) and must reject it, naming the field; the same object
unbroken must pass, so the rejection is the broken field's doing. test_manifests.py runs the same validators on
every object under deploy/ and certs/manifests/.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import schemas
from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"
MONITORING = DEPLOY / "monitoring"
RULES = DEPLOY / "prometheus" / "rules"
AGENT_POOLS = ("pool-a", "pool-b")

Doc = dict[str, Any]


@functools.cache
def render(directory: Path) -> tuple[Doc, ...]:
    docs = schemas.render(directory)
    assert docs, f"{directory} renders nothing"
    return docs


def get(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------- every check can fail


def _container(doc: Doc) -> Doc:
    container: Doc = doc["spec"]["template"]["spec"]["containers"][0]
    return container


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    """A mutation that sets the field at a dotted path (list indices as numbers)."""

    def mutate(doc: Doc) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = value

    return mutate


# (what, kustomization, kind, name, mutation, the words the validator must say)
BROKEN: list[tuple[str, str, str, str, Callable[[Doc], None], str]] = [
    ("unknown field in a Deployment's container", "agent/overlays/pool-a", "Deployment", "raven-agent-pool-a",
     lambda d: _container(d).update(livenesProbe={}), "livenesProbe"),
    ("wrong type in a DaemonSet", "overlays/production", "DaemonSet", "raven-gateway",
     _set("spec.revisionHistoryLimit", "five"), "revisionHistoryLimit"),
    ("unknown field in a Service port", "monitoring", "Service", "raven-gateway-metrics",
     _set("spec.ports.0.targetPot", 10265), "targetPot"),
    ("wrong type in a ServiceMonitor", "monitoring", "ServiceMonitor", "raven-gateway",
     _set("spec.endpoints.0.port", 10265), "spec.endpoints[0].port: must be string"),
    ("unknown field in a ServiceMonitor", "monitoring", "ServiceMonitor", "raven-gateway",
     _set("spec.endpoints.0.intervall", "30s"), "spec.endpoints[0].intervall: unknown field"),
    ("bad relabel action in a PodMonitor", "monitoring", "PodMonitor", "raven-agent",
     _set("spec.podMetricsEndpoints.0.relabelings.0.action", "rename"), "action: must be equal to one of"),
    ("bad duration in a ScrapeConfig", "monitoring", "ScrapeConfig", "raven-edge-dcgm",
     _set("spec.scrapeInterval", "30 seconds"), "spec.scrapeInterval: must match pattern"),
    ("Secret key missing in a ScrapeConfig", "monitoring", "ScrapeConfig", "raven-edge-dcgm",
     lambda d: d["spec"]["authorization"]["credentials"].pop("key"),
     "spec.authorization.credentials: must have required property key"),
    ("unknown field in a PrometheusRule's alert", "monitoring", "PrometheusRule", "raven",
     lambda d: d["spec"]["groups"][1]["rules"][0].update(fr="5m"), "spec.groups[1].rules[0].fr: unknown field"),
    ("wrong type in a PrometheusRule", "monitoring", "PrometheusRule", "raven",
     _set("spec.groups.0.rules", {"record": "x"}), "spec.groups[0].rules: must be array"),
    ("bad field in a cert-manager Certificate", "../certs/manifests", "Certificate", "raven-gateway",
     _set("spec.privateKey.algorithm", "ECDSA-256"), "spec.privateKey.algorithm: must be equal to one of"),
    ("unknown field in a cert-manager Certificate", "../certs/manifests", "Certificate", "raven-gateway",
     _set("spec.dnsName", ["raven-gateway"]), "spec.dnsName: unknown field"),
    ("wrong type in a cert-manager Issuer", "../certs/manifests", "Issuer", "raven-ca",
     _set("spec.ca.secretName", 7), "spec.ca.secretName: must be string"),
]


@pytest.mark.parametrize(("directory", "kind", "name", "mutate", "said"), [b[1:] for b in BROKEN],
                         ids=[b[0] for b in BROKEN])
def test_validator_rejects_a_broken_field(directory: str, kind: str, name: str, mutate: Callable[[Doc], None],
                                          said: str) -> None:
    doc = get(render(DEPLOY / directory), kind, name)
    broken = copy.deepcopy(doc)
    mutate(broken)
    intact, rejected = schemas.schema_errors([doc, broken])
    assert intact == [], f"{kind}/{name} as shipped: {intact}"
    assert rejected, f"{kind}/{name} with a broken field passed its validator"
    assert any(said in e for e in rejected), f"expected a complaint with {said!r}, got {rejected}"
    if not schemas.is_custom(doc):
        assert len(rejected) == len(schemas.K8S_VERSIONS), "every Kubernetes version's schema rejects it"


def test_every_object_kind_has_a_validator() -> None:
    """An object of an API group that no validator knows is an error, not a pass."""
    alien = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    (errors,) = schemas.schema_errors([alien])
    assert errors and all("example.com/v1" in e or "Widget" in e for e in errors), errors
    unknown_kind = {"apiVersion": "monitoring.coreos.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}}
    (errors,) = schemas.custom_errors([unknown_kind])
    assert errors == ["@kubernetes-models/prometheus-operator has no Widget in monitoring.coreos.com/v1"]


# ---------------------------------------------------------------- the monitoring component


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_monitoring_component_objects() -> None:
    docs = render(MONITORING)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [("PodMonitor", "raven-agent"), ("PrometheusRule", "raven"), ("ScrapeConfig", "raven-direct-dcgm"),
                     ("ScrapeConfig", "raven-edge-dcgm"), ("Service", "raven-gateway-metrics"),
                     ("ServiceMonitor", "raven-gateway")]
    for doc in docs:
        if schemas.is_custom(doc):
            # kube-prometheus-stack's default selectors want the Helm release's label (README.md says how to change it)
            assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack", doc["metadata"]["name"]


def test_service_monitor_scrapes_every_gateway_replica() -> None:
    docs = render(MONITORING)
    gateway = get(render(DEPLOY / "overlays/production"), "DaemonSet", "raven-gateway")
    monitor = get(docs, "ServiceMonitor", "raven-gateway")
    service = get(docs, "Service", "raven-gateway-metrics")
    namespace = gateway["metadata"]["namespace"]
    assert service["metadata"]["namespace"] == namespace
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [namespace]
    assert _labels_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    # The front Service must not be selected as well (every replica would be scraped twice).
    front = get(render(DEPLOY / "overlays/production"), "Service", "raven-gateway")
    assert not _labels_match(monitor["spec"]["selector"]["matchLabels"], front["metadata"]["labels"])
    pod_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert _labels_match(service["spec"]["selector"], pod_labels)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port["targetPort"] == container_ports["metrics"] == 10265
    assert endpoint["path"] == "/metrics"


@pytest.mark.parametrize("pool", AGENT_POOLS)
def test_pod_monitor_scrapes_every_pool_with_its_pool_label(pool: str) -> None:
    monitor = get(render(MONITORING), "PodMonitor", "raven-agent")
    agent = get(render(DEPLOY / "agent/overlays" / pool), "Deployment", f"raven-agent-{pool}")
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [agent["metadata"]["namespace"]]
    pod_labels = agent["spec"]["template"]["metadata"]["labels"]
    assert _labels_match(monitor["spec"]["selector"]["matchLabels"], pod_labels)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for p in agent["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert endpoint["port"] in ports
    # The relabelling that gives agent series their `pool` (the rules and dashboards rely on it), applied to this
    # overlay's pod label as Prometheus would: an anchored regex, $1 expanded.
    (rule,) = [r for r in endpoint["relabelings"] if r.get("targetLabel") == "pool"]
    (source,) = rule["sourceLabels"]
    label = source.removeprefix("__meta_kubernetes_pod_label_")
    value = next(v for k, v in pod_labels.items() if re.sub(r"[^a-zA-Z0-9_]", "_", k) == label)
    match = re.fullmatch(rule["regex"], value)
    assert match is not None and rule["replacement"].replace("$1", match.group(1)) == pool


def test_scrape_config_matches_the_gateway_and_the_plain_job() -> None:
    """The ScrapeConfig is the edge-dcgm job of deploy/prometheus/scrape-config.yaml, with the token from the
    gateway's own Secret, and points at the gateway's Service ports."""
    scrape = get(render(MONITORING), "ScrapeConfig", "raven-edge-dcgm")["spec"]
    production = render(DEPLOY / "overlays/production")
    gateway = get(production, "DaemonSet", "raven-gateway")
    namespace = gateway["metadata"]["namespace"]
    front = get(production, "Service", "raven-gateway")
    ports = {p["name"]: p["port"] for p in front["spec"]["ports"]}
    # The token: the Secret the gateway mounts for front.auth.token_files, the file name being the key.
    configmap = next(d for d in production if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(
        "raven-gateway-config"))
    (token_file,) = yaml.safe_load(next(iter(configmap["data"].values())))["front"]["auth"]["token_files"]
    mount = next(m for m in gateway["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                 if token_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    secret = {"name": volume["secret"]["secretName"], "key": Path(token_file).name}
    assert scrape["authorization"] == {"type": "Bearer", "credentials": secret}
    (sd,) = scrape["httpSDConfigs"]
    assert sd["authorization"] == {"type": "Bearer", "credentials": secret}
    assert sd["url"] == f"http://raven-gateway.{namespace}.svc:{ports['metrics']}/sd?port={ports['dcgm']}&group=pool"

    plain = {j["job_name"]: j for j in yaml.safe_load((DEPLOY / "prometheus/scrape-config.yaml").read_text())[
        "scrape_configs"]}[scrape["jobName"]]
    assert (scrape["scrapeInterval"], scrape["scrapeTimeout"], scrape["metricsPath"]) == (
        plain["scrape_interval"], plain["scrape_timeout"], plain["metrics_path"])
    assert sd["url"] == plain["http_sd_configs"][0]["url"]
    assert sd["refreshInterval"] == plain["http_sd_configs"][0]["refresh_interval"]
    assert "proxyUrl" not in scrape and "proxy_url" not in plain
    as_prometheus = [{_snake(k): v for k, v in r.items()} for r in scrape["relabelings"]]
    assert as_prometheus == plain["relabel_configs"]

    # The direct pools' job: the same discovery, no proxy, no token for the nodes, the other reaches.
    direct = get(render(MONITORING), "ScrapeConfig", "raven-direct-dcgm")["spec"]
    plain_direct = {j["job_name"]: j for j in yaml.safe_load((DEPLOY / "prometheus/scrape-config.yaml").read_text())[
        "scrape_configs"]}[direct["jobName"]]
    (direct_sd,) = direct["httpSDConfigs"]
    assert direct_sd["url"] == sd["url"] == plain_direct["http_sd_configs"][0]["url"]
    assert direct_sd["authorization"] == sd["authorization"]
    assert "authorization" not in direct and "authorization" not in plain_direct
    assert [{_snake(k): v for k, v in r.items()} for r in direct["relabelings"]] == plain_direct["relabel_configs"]


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


def test_prometheus_rule_is_the_rule_file() -> None:
    """The PrometheusRule the component ships has exactly the groups of raven.rules.yaml (promtool-tested)."""
    rule = get(render(MONITORING), "PrometheusRule", "raven")
    source = yaml.safe_load((RULES / "raven.rules.yaml").read_text())
    assert rule["spec"] == {"groups": source["groups"]}
