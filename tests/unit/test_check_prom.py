"""raven check's Prometheus verdict (raven/check/prom.py) on what was read: no Prometheus, an unreachable one, no
edge job, a node with no target; each a ✘ with what to run. (A real Prometheus with a node down:
tests/integration/test_check.py.)"""

from __future__ import annotations

from raven.check import prom
from raven.check.reader import ReplicaRead


def test_no_prometheus_found_says_how_to_point_at_one() -> None:
    r = prom.prometheus(None)
    assert not r.ok and "operated-prometheus=true" in r.detail and "--prometheus" in r.fix


def test_no_edge_job_names_the_scrape_objects() -> None:
    r = prom.prometheus(prom.PromRead("http://p:9090"))
    assert not r.ok and "no target in job edge-dcgm" in r.detail
    assert "scrapeconfig raven-edge-dcgm" in r.fix and "release:" in r.fix and "scrape-config.yaml" in r.fix


def test_unreachable_and_missing_target() -> None:
    r = prom.prometheus(prom.PromRead("http://p:9090", error="cannot connect to http://p:9090/api/v1/query: x"))
    assert not r.ok and "port-forward svc/prometheus-operated 9090" in r.fix
    r = prom.prometheus(prom.PromRead("http://p:9090", jobs={"edge-dcgm": 3}, sample={"gpu-1": 1.0, "gpu-2": None}))
    assert not r.ok and "no edge target for gpu-2" in r.detail and "--node gpu-2" in r.fix


def test_the_sample_takes_only_node_names() -> None:
    """Names go into a PromQL regex: anything that is not an RFC 1123 name (a quote, a brace) is left out."""
    status = {"nodes": [{"name": 'x"}) or vector(1', "reach": "tunnel"}, {"name": "gpu-1", "reach": "tunnel"},
                        {"name": "dc-1", "reach": "direct"}]}
    assert prom.sample_nodes({"u": ReplicaRead(status)}, []) == ["gpu-1"]
    assert prom.service_url([{"metadata": {"name": "prometheus-operated", "namespace": "monitoring"},
                              "spec": {"ports": [{"name": "web", "port": 9090}]}}]) == \
        "http://prometheus-operated.monitoring.svc:9090"
