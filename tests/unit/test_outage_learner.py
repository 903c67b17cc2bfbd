"""What the agent learns from the scrapes it relays (agent/outage.py): cadence, path, Accept, timeout."""

from __future__ import annotations

from agent.outage import DEFAULT_ACCEPT, Learner, accept_of
from raven.protocol import wire

PROM_ACCEPT = ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.6,"
               "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4,*/*;q=0.1")


def _scrape(node: str = "edge-gpu-1", target: str = "/metrics", accept: str = PROM_ACCEPT,
            method: str = "GET") -> wire.Open:
    return wire.Open(1, wire.StreamKind.HTTP, node, 9400, method, target, (("Accept", accept),))


def test_cadence_path_accept_and_timeout_are_learned_per_target() -> None:
    ln = Learner()
    for i in range(4):
        ln.observe(_scrape(), 10.0, "prom-0", 1000.0 + 15 * i)
    t = ln.targets[("edge-gpu-1", 9400, "/metrics")]
    assert t.learned and abs(t.interval - 15) < 1e-9
    assert t.timeout == 10.0 and t.last == 1045.0
    assert "protobuf" not in t.accept and "text/plain;version=0.0.4" in t.accept


def test_an_ha_pair_at_the_same_interval_is_not_taken_for_twice_the_rate() -> None:
    ln = Learner()
    for i in range(4):
        ln.observe(_scrape(), 10.0, "prom-0", 1000.0 + 15 * i)
        ln.observe(_scrape(), 10.0, "prom-1", 1007.0 + 15 * i)
    assert abs(ln.targets[("edge-gpu-1", 9400, "/metrics")].interval - 15) < 1e-9


def test_a_changed_interval_is_taken_at_once() -> None:
    ln = Learner()
    for at in (0, 15, 30, 60, 90):
        ln.observe(_scrape(), 10.0, "p", 1000.0 + at)
    assert ln.targets[("edge-gpu-1", 9400, "/metrics")].interval == 30


def test_what_is_not_a_scrape_is_not_learned() -> None:
    ln = Learner()
    for i in range(3):
        ln.observe(_scrape(accept="text/html"), 10.0, "browser", 1000.0 + i)
        ln.observe(_scrape(node="edge-gpu-2", method="HEAD"), 10.0, "p", 1000.0 + i)
    assert not ln.targets
    ln.observe(_scrape(), 10.0, "p", 1000.0)
    assert not ln.targets[("edge-gpu-1", 9400, "/metrics")].learned  # one scrape: no cadence, never scraped


def test_the_learned_targets_are_bounded() -> None:
    ln = Learner(max_targets=3)
    for i in range(5):
        ln.observe(_scrape(node=f"edge-gpu-{i}"), 10.0, "p", 1000.0)
    assert len(ln.targets) == 3 and ("edge-gpu-4", 9400, "/metrics") in ln.targets


def test_accept_without_protobuf() -> None:
    assert accept_of((("accept", "application/vnd.google.protobuf;q=0.6,text/plain;version=0.0.4"),)) == \
        "text/plain;version=0.0.4"
    assert accept_of((("accept", "*/*"),)) == ""
    assert DEFAULT_ACCEPT.startswith("text/plain")
