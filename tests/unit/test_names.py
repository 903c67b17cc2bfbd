"""The rule for names that reach DNS (raven/dns/names.py)."""

from __future__ import annotations

import pytest

from raven.config import NameRules
from raven.dns.names import NameRule


@pytest.mark.parametrize("name", ["edge-gpu-7", "gpu-0001", "a", "node-1.edge.example.com", "7gpu", "x1"])
def test_node_names_pass(name: str) -> None:
    assert NameRule().refusal(name) is None


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("localhost", "reserved-name"),
        ("kubernetes", "reserved-name"),
        ("kube-dns", "reserved-name"),
        ("coredns", "reserved-name"),
        ("metadata", "reserved-name"),
        ("metadata.google.internal", "reserved-name"),
        ("prometheus", "reserved-name"),
        ("raven-gateway", "reserved-name"),
        ("cluster.local", "reserved-name"),
        ("kube-dns.kube-system.svc.cluster.local", "reserved-suffix"),
        ("x.svc", "reserved-suffix"),
        ("printer.local", "reserved-suffix"),
        ("2130706433", "reads-as-address"),
        ("10.0.0.1", "reads-as-address"),
        ("0x7f000001", "reads-as-address"),
        ("Edge-GPU-7", "invalid-name"),
        ("edge_gpu", "invalid-name"),
        ("-edge", "invalid-name"),
        ("a" * 64, "invalid-name"),
        ("", "invalid-name"),
    ],
)
def test_names_of_the_cluster_are_refused(name: str, label: str) -> None:
    refusal = NameRule().refusal(name)
    assert refusal is not None and refusal.label == label, refusal


def test_configured_rule() -> None:
    rule = NameRules(extra_denied_names=["my-svc"], cluster_domain="corp.example").rule()
    assert rule.refusal("my-svc") is not None
    assert rule.refusal("x.corp.example") is not None
    assert rule.refusal("x.cluster.example") is None
    assert rule.refusal("kube-dns") is not None  # the defaults stay
