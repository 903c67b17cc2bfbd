"""/metrics written with each sample's head kept (raven/ops/exposition.py): byte for byte what prometheus-client's
generate_latest writes, for both services' registries with a fleet's series and hostile label values, as the
counters move and labels come and go; and it costs the interpreter lock (which the event loop needs) less."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from raven.ops import exposition
from raven.ops.exposition import Exposition
from raven.ops.metrics import AgentMetrics, GatewayMetrics
from raven.ops.server import MetricsPage

HOSTILE = ['pool "a"', "back\\slash", "new\nline", "ünïcode-✓", "", "x" * 300]


def steady(text: bytes | None) -> bytes:
    """The text without the process collector's samples (CPU seconds and memory move between two reads; their
    HELP and TYPE lines stay, and the collector's text is prometheus_client's own either way)."""
    assert text is not None
    return b"".join(line for line in text.splitlines(keepends=True) if not line.startswith(b"process_"))


def gateway_registry() -> GatewayMetrics:
    m = GatewayMetrics()
    for p in [*(f"pool-{k}" for k in range(10)), *HOSTILE]:
        for code in ("200", "502", "broken-502"):
            m.requests.labels(p, "scrape", code).inc()
        m.latency.labels(p).observe(0.004)
        m.bytes.labels(p, "from_edge").inc(1e12)  # a large value: Go's exponent notation
        m.nodes.labels(p).set(1000)
    m.cert_expiry.labels("gateway", "CN=gw").set(1.8e9)
    return m


def test_the_text_is_generate_latests_byte_for_byte_as_the_counters_move_and_labels_come_and_go() -> None:
    gw, agent = gateway_registry(), AgentMetrics()
    agent.requests.labels("scrape", "200").inc(3)
    for registry in (gw.registry, agent.registry):
        writer = Exposition(registry)
        assert steady(writer.render()) == steady(generate_latest(registry))
    writer = Exposition(gw.registry)
    for step in range(3):
        gw.requests.labels("pool-1", "scrape", "200").inc(step + 0.5)
        gw.latency.labels(f"new-{step}").observe(float("inf") if step else 7.0)
        gw.nodes.remove('pool "a"') if step == 1 else gw.nodes.labels("pool-0").set(float("nan"))
        assert steady(writer.render()) == steady(generate_latest(gw.registry))


def test_every_kind_of_metric_and_names_it_leaves_to_prometheus_client() -> None:
    r = CollectorRegistry()
    Counter("c", "a counter\nwith \\ in its help", ["l"], registry=r).labels("v").inc()
    Gauge("g", "gauge", registry=r).set(-2.5)
    Histogram("h", "histogram", buckets=(0.1, 1.0), registry=r).observe(0.5)
    Summary("s", "summary", registry=r).observe(1)
    Info("i", "info", registry=r).info({"version": "1.2", "odd": 'q"uote'})
    Enum("e", "enum", states=["a", "b"], registry=r).state("b")
    assert Exposition(r).render() == generate_latest(r)

    class Odd(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            family = GaugeMetricFamily("odd.name", "a name outside the classic set", labels=["l"])
            family.add_metric(["v"], 1.0)
            yield family

    r.register(Odd())
    assert Exposition(r).render() == generate_latest(r)  # written by generate_latest itself


def test_the_kept_heads_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    r = CollectorRegistry()
    gauge = Gauge("g", "gauge", ["l"], registry=r)
    writer = Exposition(r)
    monkeypatch.setattr(exposition, "MAX_HEADS", 50)
    for k in range(200):
        gauge.clear()
        gauge.labels(f"v{k}").set(k)
        assert writer.render() == generate_latest(r)
        assert len(writer._heads) <= 50


def test_a_scrape_formats_only_the_values_once_the_heads_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """What it saves (about half of generate_latest's CPU, bench/bench_views.py): no label formatted again."""
    gw = gateway_registry()
    writer = Exposition(gw.registry)
    first = writer.render()
    formatted: list[str] = []
    real = exposition._value
    def counted(text: str) -> str:
        formatted.append(text)
        return real(text)

    monkeypatch.setattr(exposition, "_value", counted)
    gw.requests.labels("pool-1", "scrape", "200").inc()
    again = writer.render()
    assert again != first and steady(again) == steady(generate_latest(gw.registry)) and formatted == []
    gw.requests.labels("pool-1", "scrape", "504").inc()  # a new series: only its own labels are formatted
    assert steady(writer.render()) == steady(generate_latest(gw.registry))
    assert sorted(set(formatted)) == ["504", "pool-1", "scrape"]


async def test_the_metrics_page_of_the_ops_listener_keeps_the_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    gw = gateway_registry()
    page = MetricsPage(gw.registry)
    formatted: list[str] = []
    real = exposition._value

    def counted(text: str) -> str:
        formatted.append(text)
        return real(text)

    monkeypatch.setattr(exposition, "_value", counted)
    first = await page.page()
    assert steady(first.body) == steady(generate_latest(gw.registry))
    assert formatted  # the first scrape formats the heads
    formatted.clear()
    gw.requests.labels("pool-2", "scrape", "200").inc()
    second = await page.page()
    assert steady(second.body) == steady(generate_latest(gw.registry)) and second.body != first.body
    assert formatted == []
