"""raven/hostport.py: the one place an address becomes a URL host (IPv6 bracketed once) and HOST:PORT is read."""

from __future__ import annotations

import pytest
from yarl import URL

from agent.checks import Policy, check_open
from agent.targets import _with_host
from raven.hostport import split_host_port, url_host
from raven.protocol import wire


@pytest.mark.parametrize(("address", "host"), [
    ("10.0.0.7", "10.0.0.7"), ("edge-gpu-7", "edge-gpu-7"), ("fd00::7", "[fd00::7]"), ("[fd00::7]", "[fd00::7]"),
])
def test_url_host_brackets_ipv6_once(address: str, host: str) -> None:
    assert url_host(address) == host
    assert URL(f"http://{url_host(address)}:9400/metrics").host == address.strip("[]")


@pytest.mark.parametrize(("listen", "split"), [
    ("0.0.0.0:8080", ("0.0.0.0", 8080)), ("[::]:443", ("::", 443)), (":9090", ("0.0.0.0", 9090)),
])
def test_split_host_port(listen: str, split: tuple[str, int]) -> None:
    assert split_host_port(listen) == split


def test_an_ipv6_node_is_dialled_bracketed_by_every_user() -> None:
    policy = Policy(frozenset({9400}), frozenset({"GET"}), allow_connect=False, request_timeout=10.0)
    frame = wire.Open(1, wire.StreamKind.HTTP, "edge-gpu-7", 9400, "GET", "/metrics", (), True)
    request = check_open(frame, "fd00::7", policy)
    assert str(request.url) == "http://[fd00::7]:9400/metrics"
    assert _with_host("https://gw.example:443/tunnel", "fd00::1") == "https://[fd00::1]:443/tunnel"
