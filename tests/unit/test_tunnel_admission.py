"""The gateway's admission of a HELLO (gateway/tunnel.py) without sockets: each refusal's code, and the
handshake counter labelled from it, never from the text."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import pytest

from gateway.registry import AgentSession, Registry
from gateway.tunnel import Claim, TunnelEndpoint
from raven.config import GatewayConfig
from raven.ops.metrics import GatewayMetrics
from raven.protocol import wire
from raven.protocol.errors import HandshakeCode, RemoteProtocolError
from raven.refusals import HandshakeRefused, Reason, Where

CLAIM = Claim("agent-1", "agent-1", frozenset({"pool-a"}), ())


def endpoint(tmp_path: Path, **tree: object) -> TunnelEndpoint:
    for name in ("cert", "key", "ca"):
        (tmp_path / name).write_text("x")
    tls = {"cert": str(tmp_path / "cert"), "key": str(tmp_path / "key"), "ca": str(tmp_path / "ca")}
    cfg = GatewayConfig.model_validate({"tls": tls, "front": {"listen": "127.0.0.1:1"}, **tree})
    return TunnelEndpoint(cfg, Registry(), GatewayMetrics())


def hello(agent: str = "agent-1", versions: tuple[int, ...] = wire.SUPPORTED_VERSIONS,
          release: str = "0.3.0") -> wire.Hello:
    return wire.Hello(agent, "0123456789abcdef", versions, release=release)


def refused(tunnel: TunnelEndpoint, h: wire.Hello) -> HandshakeRefused:
    with pytest.raises(HandshakeRefused) as info:
        tunnel._admit(CLAIM, "192.0.2.1", h)
    assert info.value.reason.where is Where.HANDSHAKE
    return info.value


def failures(tunnel: TunnelEndpoint, label: str) -> float:
    value = tunnel.metrics.registry.get_sample_value("raven_gateway_handshake_failures_total", {"reason": label})
    return value or 0.0


def test_an_admitted_hello_is_welcomed(tmp_path: Path) -> None:
    welcome = endpoint(tmp_path)._admit(CLAIM, "192.0.2.1", hello())
    assert welcome.version == max(wire.SUPPORTED_VERSIONS)


def test_each_refusal_has_its_code(tmp_path: Path) -> None:
    tunnel = endpoint(tmp_path, tunnel={"min_agent_version": "0.3.0"}, session_burst=2,
                      session_rate=0.001)
    err = refused(tunnel, hello(agent="agent-2"))
    assert (err.reason, err.key) == (Reason.HELLO_AGENT_MISMATCH, "192.0.2.1")
    err = refused(tunnel, hello(versions=(99,)))
    assert err.reason is Reason.VERSION and err.text.endswith("(see docs/skew.md)") and err.key == "agent-1"
    err = refused(tunnel, hello(release="0.2.0"))
    assert err.reason is Reason.AGENT_VERSION and "tunnel.min_agent_version" in err.text
    err = refused(tunnel, hello())  # the burst of 2 went to the two HELLOs before
    assert err.reason is Reason.SESSION_RATE


def test_session_caps_are_refused_with_their_codes(tmp_path: Path) -> None:
    tunnel = endpoint(tmp_path, max_sessions_per_agent=1, max_sessions_total=2)
    fake: object = object()
    tunnel.registry.add_session(AgentSession("agent-1", "s1", CLAIM.pools, fake))  # type: ignore[arg-type]
    assert refused(tunnel, hello()).reason is Reason.AGENT_SESSION_CAP
    tunnel.registry.add_session(AgentSession("agent-9", "s9", CLAIM.pools, fake))  # type: ignore[arg-type]
    tunnel.cfg = tunnel.cfg.model_copy(update={"max_sessions_per_agent": 5})
    assert refused(tunnel, hello()).reason is Reason.SESSION_CAP


def test_the_counter_is_labelled_by_the_code(tmp_path: Path) -> None:
    tunnel = endpoint(tmp_path)
    # Text that reads like another label: counted under the reason's label all the same.
    tunnel._refused(CLAIM, "192.0.2.1", HandshakeRefused(Reason.SESSION_RATE, "session-cap: words"), True)
    assert (failures(tunnel, "session-rate"), failures(tunnel, "session-cap")) == (1.0, 0.0)
    # The core's codes are counted under the gateway's labels for them (the mapping lives with the service).
    tunnel._refused(CLAIM, "192.0.2.1", RemoteProtocolError(HandshakeCode.BAD_HELLO, "version: words"), True)
    assert (failures(tunnel, "bad-hello"), failures(tunnel, "version")) == (1.0, 0.0)
    # A HELLO that never came is logged, not counted.
    tunnel._refused(CLAIM, "192.0.2.1", RemoteProtocolError(HandshakeCode.NO_HELLO, "no HELLO within 10s"), False)
    assert failures(tunnel, "no-hello") == 0.0


def test_a_refused_upgrade_is_answered_with_the_reasons_status(tmp_path: Path) -> None:
    tunnel = endpoint(tmp_path)
    resp = tunnel._refuse("192.0.2.1", Reason.UNREADABLE_CLIENT_CERTIFICATE, "unreadable client certificate: bad")
    assert (resp.status, resp.text) == (403, "unreadable client certificate: bad\n")
    assert failures(tunnel, "unreadable client certificate") == 1.0


def test_a_flood_of_failed_tls_handshakes_logs_one_line_a_minute_per_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The tunnel's TLS failures go through the house's one rate-limited log (raven/lograte.py): every failure
    is counted, one line per reason a minute gets through, and the next one says how many were held back."""
    tunnel = endpoint(tmp_path)
    clock = [1000.0]
    tunnel._log.clock = lambda: clock[0]
    bad_cert = ssl.SSLCertVerificationError(1, "certificate verify failed")
    bad_cert.reason = "CERTIFICATE_VERIFY_FAILED"
    plain_http = ssl.SSLError(1, "http request")
    plain_http.reason = "HTTP_REQUEST"
    with caplog.at_level(logging.WARNING, logger="raven.gateway.tunnel"):
        for _ in range(500):
            tunnel.tls_failed(bad_cert)
            tunnel.tls_failed(plain_http)
        clock[0] += 61.0
        tunnel.tls_failed(bad_cert)
    lines = [r.getMessage() for r in caplog.records if "TLS handshake" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "not signed by this gateway's CA" in lines[0] and "plain HTTP" in lines[1]
    assert "499 more like it" in lines[2]
    assert tunnel.metrics.handshake_failures.labels("tls CERTIFICATE_VERIFY_FAILED")._value.get() == 501
