"""gateway/request.py without sockets: which node and port a front-end request is for, or why it is refused."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from gateway.request import (
    Refusal,
    check_header_block,
    client_key,
    content_length,
    header_safe,
    parse_target,
)
from raven.protocol import wire


def target(method: str, path: str, host: str | None = None) -> object:
    headers = {"Host": host} if host is not None else {}
    return parse_target(make_mocked_request(method, path, headers=headers))


def refusal(method: str, path: str, host: str | None = None) -> Refusal:
    with pytest.raises(Refusal) as info:
        target(method, path, host)
    return info.value


def test_host_header_mode() -> None:
    t = parse_target(make_mocked_request("GET", "/metrics?x=1", headers={"Host": "Edge-GPU-7.:9400"}))
    assert (t.node, t.port, t.path, t.kind) == ("edge-gpu-7", 9400, "/metrics?x=1", wire.StreamKind.HTTP)


def test_default_port_is_80() -> None:
    t = parse_target(make_mocked_request("GET", "/", headers={"Host": "edge-gpu-7"}))
    assert t.port == 80


def test_absolute_uri_mode_ignores_user_info() -> None:
    t = parse_target(make_mocked_request("GET", "http://user:pw@edge-gpu-7:9100/metrics?a=b",
                                         headers={"Host": "other:1"}))
    assert (t.node, t.port, t.path) == ("edge-gpu-7", 9100, "/metrics?a=b")


def test_connect_mode() -> None:
    t = parse_target(make_mocked_request("CONNECT", "edge-gpu-7:10250", headers={"Host": "edge-gpu-7:10250"}))
    assert (t.node, t.port, t.path, t.kind) == ("edge-gpu-7", 10250, "", wire.StreamKind.TCP)


@pytest.mark.parametrize(
    ("method", "path", "host"),
    [
        ("GET", "/metrics", None),
        ("GET", "/metrics", "edge-gpu-7:0"),
        ("GET", "/metrics", "edge-gpu-7:65536"),
        ("GET", "/metrics", "edge-gpu-7:9x"),
        ("GET", "/metrics", "edge_gpu:9400"),
        ("GET", "/metrics", "[::1]:9400"),
        ("GET", "https://edge-gpu-7:9400/metrics", "x"),
        ("CONNECT", "edge-gpu-7", "edge-gpu-7"),
    ],
)
def test_requests_without_a_usable_node_or_port_are_400(method: str, path: str, host: str | None) -> None:
    err = refusal(method, path, host)
    assert err.status == 400 and err.text


def test_content_length_is_strict() -> None:
    assert content_length(None) is None
    assert content_length("0") == 0 and content_length("123") == 123
    for bad in ("-1", "1.0", " 1", "0x10", "1" * 19, "١٢"):
        with pytest.raises(Refusal):
            content_length(bad)


def test_header_block_must_fit_the_wire() -> None:
    check_header_block((("A", "b"),), wire.DEFAULT_LIMITS)
    with pytest.raises(Refusal) as info:
        check_header_block((("A", "é€"),), wire.DEFAULT_LIMITS)
    assert info.value.status == 400
    with pytest.raises(Refusal) as info:
        check_header_block((("A", "x" * (wire.DEFAULT_LIMITS.max_header_bytes + 1)),), wire.DEFAULT_LIMITS)
    assert info.value.status == 431


def test_header_safe_and_client_key() -> None:
    assert header_safe("a\r\nb\x00é") == "a??b??"
    assert len(header_safe("x" * 1000)) == 200
    assert client_key("10.0.0.1") == client_key("10.0.0.1") != client_key("10.0.0.2")
    assert len(client_key("10.0.0.1")) == 16
