"""agent/checks.py without sockets: every OPEN a gateway can send is checked again at the edge."""

from __future__ import annotations

import pytest

from agent.checks import Policy, check_open
from raven.protocol import wire
from raven.protocol.headers import CLIENT_HEADER, DEADLINE_HEADER
from raven.refusals import Refusal

POLICY = Policy(frozenset({9400}), frozenset({"GET", "HEAD"}), allow_connect=False, request_timeout=10.0)
ADDRESS = "10.1.0.7"


def http(target: str = "/metrics", method: str = "GET", port: int = 9400, headers: wire.Headers = ()) -> wire.Open:
    return wire.Open(1, wire.StreamKind.HTTP, "edge-gpu-7", port, method, target, headers, True)


def refused(frame: wire.Open, address: str | None = ADDRESS, policy: Policy = POLICY) -> Refusal:
    with pytest.raises(Refusal) as info:
        check_open(frame, address, policy)
    return info.value


def test_a_good_open_becomes_a_url_on_the_inventory_address() -> None:
    req = check_open(http("/metrics?collect[]=gpu"), ADDRESS, POLICY)
    assert str(req.url) == "http://10.1.0.7:9400/metrics?collect[]=gpu"
    assert req.address == ADDRESS and req.deadline.budget == 10.0 and req.client == "-"


def test_ipv6_inventory_address() -> None:
    req = check_open(http(), "fd00::7", POLICY)
    assert req.url.host == "fd00::7" and req.url.port == 9400


@pytest.mark.parametrize(
    ("frame", "address", "label"),
    [
        (http(), None, "node"),
        (http(port=22), ADDRESS, "port"),
        (http(method="POST"), ADDRESS, "method"),
        (http(method="CONNECT"), ADDRESS, "method"),
        (wire.Open(1, wire.StreamKind.TCP, "edge-gpu-7", 9400), ADDRESS, "connect"),
        (http("http://10.9.9.9:9400/metrics"), ADDRESS, "target"),
        (http("//10.9.9.9/metrics"), ADDRESS, "target"),
        (http("@10.9.9.9:9400/x"), ADDRESS, "target"),
        (http("/a b"), ADDRESS, "target"),
        (http("/a\\b"), ADDRESS, "target"),
        (http("/a#frag"), ADDRESS, "target"),
        (http("*"), ADDRESS, "target"),
        (http("/" + "a" * 9000), ADDRESS, "target"),
    ],
)
def test_what_a_gateway_cannot_make_the_agent_do(frame: wire.Open, address: str | None, label: str) -> None:
    err = refused(frame, address)
    assert err.label == label and err.text
    assert err.reset_code == wire.ResetCode.REFUSED


def test_connect_only_where_enabled_and_only_to_the_inventory_address() -> None:
    policy = Policy(frozenset({10250}), frozenset({"GET"}), allow_connect=True, request_timeout=5.0)
    req = check_open(wire.Open(1, wire.StreamKind.TCP, "edge-gpu-7", 10250), ADDRESS, policy)
    assert (req.url.scheme, req.url.host, req.url.port) == ("tcp", ADDRESS, 10250)


def test_raven_and_framing_headers_never_reach_the_node() -> None:
    headers = (
        ("Accept", "text/plain"), (DEADLINE_HEADER, "2500"), (CLIENT_HEADER, "abc123"), ("X-Raven-Other", "x"),
        ("Connection", "close"), ("Transfer-Encoding", "chunked"), ("Content-Length", "5"), ("Keep-Alive", "1"),
    )
    req = check_open(http(headers=headers), ADDRESS, POLICY)
    assert req.headers == (("Accept", "text/plain"),)
    assert req.deadline.budget == 2.5 and req.client == "abc123"


@pytest.mark.parametrize("value", ["-1", "1e9", "99999999999", "abc", "", "１２"])  # noqa: RUF001 - digits a bare isdigit() takes
def test_a_bad_deadline_keeps_the_agents_own(value: str) -> None:
    req = check_open(http(headers=((DEADLINE_HEADER, value),)), ADDRESS, POLICY)
    assert req.deadline.budget == 10.0


def test_a_deadline_never_extends_the_agents_own() -> None:
    req = check_open(http(headers=((DEADLINE_HEADER, "60000"),)), ADDRESS, POLICY)
    assert req.deadline.budget == 10.0


@pytest.mark.parametrize("value", ["", "a" * 33, "a b", "a/b", "é"])
def test_a_bad_client_key_is_ignored(value: str) -> None:
    assert check_open(http(headers=((CLIENT_HEADER, value),)), ADDRESS, POLICY).client == "-"
