"""Version skew without sockets: how releases are announced on the wire, compared, configured and shown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from gateway.statuspage import render_html, render_text
from raven import __version__, build, version
from raven.config import GatewayConfig
from raven.ops.metrics import AgentMetrics, GatewayMetrics
from raven.protocol import wire


def _control(ftype: wire.FrameType, obj: dict[str, Any]) -> bytes:
    return wire.HEADER.pack(ftype, 0, 0) + json.dumps(obj).encode()


HELLO_0_1_0 = {"agent": "a", "session": "s", "versions": [1, 2], "window": 65536, "max_streams": 10}
WELCOME_0_1_0 = {"version": 2, "replica": "gw-1", "replicas": 1, "heartbeat_interval": 3.0,
                 "heartbeat_timeout": 10.0, "window": 65536, "max_streams": 10}


def test_release_round_trips_and_unset_encodes_as_0_1_0_did() -> None:
    hello = wire.Hello("a", "s", (1, 2), 65536, 10, release="0.2.0")
    assert wire.decode(wire.encode(hello)) == hello
    assert json.loads(wire.encode(hello)[wire.HEADER_SIZE:]) == {**HELLO_0_1_0, "release": "0.2.0"}
    # Without a release the payload is 0.1.0's: the key is left out, not sent empty.
    unset = wire.encode(wire.Hello("a", "s", (1, 2), 65536, 10))
    assert json.loads(unset[wire.HEADER_SIZE:]) == HELLO_0_1_0
    welcome = wire.Welcome(2, "gw-1", 1, 3.0, 10.0, 65536, 10, release="0.2.0")
    assert wire.decode(wire.encode(welcome)) == welcome


def test_a_0_1_0_handshake_decodes_with_no_release() -> None:
    hello = wire.decode(_control(wire.FrameType.HELLO, HELLO_0_1_0))
    assert isinstance(hello, wire.Hello) and hello.release == ""
    welcome = wire.decode(_control(wire.FrameType.WELCOME, WELCOME_0_1_0))
    assert isinstance(welcome, wire.Welcome) and welcome.release == ""


def test_unknown_handshake_fields_are_ignored() -> None:
    """What lets 0.1.0 read 0.2.0's release, and this release read the next one's additions."""
    hello = wire.decode(_control(wire.FrameType.HELLO, {**HELLO_0_1_0, "release": "0.3.0", "future": {"x": 1}}))
    assert isinstance(hello, wire.Hello) and hello.release == "0.3.0"
    welcome = wire.decode(_control(wire.FrameType.WELCOME, {**WELCOME_0_1_0, "future": [1, 2]}))
    assert isinstance(welcome, wire.Welcome) and welcome.replica == "gw-1"


@pytest.mark.parametrize("bad", [3, None, True, ["0.2.0"], "x" * 65, "0.2.0\n", "0.2 0", "-1", "é"])
def test_a_bad_release_is_a_protocol_error(bad: object) -> None:
    for ftype, base in ((wire.FrameType.HELLO, HELLO_0_1_0), (wire.FrameType.WELCOME, WELCOME_0_1_0)):
        with pytest.raises(wire.ProtocolError, match="field 'release' must be a version string"):
            wire.decode(_control(ftype, {**base, "release": bad}))


def test_a_bad_release_is_not_encoded() -> None:
    with pytest.raises(ValueError, match="not a version string"):
        wire.encode(wire.Hello("a", "s", release="0.2.0\r\nX: y"))


def test_releases_compare_as_versions() -> None:
    assert version.RELEASE == __version__
    assert version.older_than("", "0.2.0")  # an agent that announces nothing is 0.1.0
    assert not version.older_than("", "0.1.0")
    assert version.older_than("0.2.0rc1", "0.2.0")
    assert not version.older_than("0.10.0", "0.9.0")  # not a string comparison
    assert version.older_than("banana", "0.1.0")  # no version at all: below any floor
    assert version.peer_release("") == "0.1.0 or older (not announced)"
    assert version.describe() == f"raven {__version__} (tunnel protocol 1,2,3; {build.running()} build)"
    with pytest.raises(ValueError):
        version.older_than("0.2.0", "banana")


def test_min_agent_version_must_be_a_version(tmp_path: Path) -> None:
    for name in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    base = {"tls": {"cert": str(tmp_path / "c.pem"), "key": str(tmp_path / "k.pem"), "ca": str(tmp_path / "ca.pem")},
            "front": {"auth": {"mode": "none"}}}
    cfg = GatewayConfig.model_validate({**base, "tunnel": {"min_agent_version": "0.2.0"}})
    assert cfg.tunnel.min_agent_version == "0.2.0"
    assert GatewayConfig.model_validate(base).tunnel.min_agent_version is None
    for bad in ("", "latest", "0.2.x"):
        with pytest.raises(ValueError, match="is not a release version"):
            GatewayConfig.model_validate({**base, "tunnel": {"min_agent_version": bad}})


def test_build_info_on_both_services() -> None:
    line = f'raven_build_info{{protocol="1,2,3",version="{__version__}"}} 1.0'
    for metrics in (GatewayMetrics(), AgentMetrics()):
        assert line in generate_latest(metrics.registry).decode()


def _snap(**extra: Any) -> dict[str, Any]:
    agent = {"agent": "agent-a-1", "session": "abcd1234", "peer": "p", "age_seconds": 5, "streams": 0,
             "draining": False, "nodes": 1}
    snap = {"replica": "gw-1", "replicas": 1, "uptime_seconds": 9, "ready": True, "ready_reason": "ok",
            "draining": False, "nodes": [], "pools": [{"pool": "a", "agents": [agent], "nodes": 1, "reachable": 1}]}
    snap.update(extra)
    return snap


def test_status_shows_releases_and_reads_a_0_1_0_gateway() -> None:
    new = _snap(version="0.2.0", protocols=[1, 2])
    new["pools"][0]["agents"][0].update(version=None, protocol=2)
    text = render_text(new)
    assert "release 0.2.0, tunnel protocol 1,2" in text
    assert "agent-a-1  <=0.1.0  2" in text
    assert "0.1.0 or older (not announced), protocol 2" in render_html(new)
    new["pools"][0]["agents"][0].update(version="0.2.0")
    assert "0.2.0, protocol 2, session" in render_html(new)
    # A 0.1.0 gateway's snapshot has no release anywhere: shown as such, not a failure.
    old = render_text(_snap())
    assert "release 0.1.0 or older (not announced)" in old and "agent-a-1" in old
    assert "0.1.0 or older (not announced), protocol ?" in render_html(_snap())
