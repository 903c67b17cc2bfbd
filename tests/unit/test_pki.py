"""Tests for raven.pki and the ``raven certs`` command group, with real certificates and real TLS."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from raven import pki
from raven.cli import certs
from raven.pki.authority import sign_leaf


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ca"
    pki.create_ca(directory)
    return directory


# --------------------------------------------------------------------------------------------------
# CA


def test_create_ca_writes_a_ca(tmp_path: Path) -> None:
    directory = tmp_path / "nested" / "dev"
    cert_path, key_path = pki.create_ca(directory, common_name="Test CA", days=30)
    assert cert_path == directory / "ca.pem"
    assert key_path == directory / "ca-key.pem"

    cert = _cert(cert_path)
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign and not ku.value.digital_signature
    cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    assert cert.signature_hash_algorithm is not None and cert.signature_hash_algorithm.name == "sha256"

    ident = pki.load_identity(cert_path)
    assert ident.role == "ca"
    assert ident.common_name == "Test CA"
    assert ident.issuer == "CN=Test CA"
    assert ident.not_after.tzinfo is not None
    assert dt.timedelta(days=29) < ident.not_after - dt.datetime.now(dt.UTC) <= dt.timedelta(days=30)


def test_create_ca_refuses_to_overwrite(tmp_path: Path) -> None:
    cert_path, _ = pki.create_ca(tmp_path)
    before = pki.load_identity(cert_path).fingerprint_sha256
    with pytest.raises(pki.PKIError, match="already exists"):
        pki.create_ca(tmp_path)
    assert pki.load_identity(cert_path).fingerprint_sha256 == before

    pki.create_ca(tmp_path, overwrite=True)
    assert pki.load_identity(cert_path).fingerprint_sha256 != before


def test_create_ca_refuses_when_only_the_key_exists(tmp_path: Path) -> None:
    (tmp_path / "ca-key.pem").write_text("precious")
    with pytest.raises(pki.PKIError, match=r"ca-key\.pem"):
        pki.create_ca(tmp_path)
    assert (tmp_path / "ca-key.pem").read_text() == "precious"


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("permissive_umask")
def test_key_files_are_private_even_with_a_permissive_umask(tmp_path: Path) -> None:
    directory = tmp_path / "dev"
    cert_path, key_path = pki.create_ca(directory)
    assert _mode(key_path) == 0o600
    assert _mode(directory) == 0o700
    assert _mode(cert_path) == 0o644

    gw_cert, gw_key = pki.issue(directory, directory, "gateway", "gw")
    ag_cert, ag_key = pki.issue(directory, directory, "agent", "edge-a", pools=["pool-a"])
    assert _mode(gw_key) == 0o600 and _mode(ag_key) == 0o600
    assert _mode(gw_cert) == 0o644 and _mode(ag_cert) == 0o644

    # Re-issuing (rotation) keeps the key private too and leaves no temporary files behind.
    pki.issue(directory, directory, "agent", "edge-a", pools=["pool-a"])
    assert _mode(ag_key) == 0o600
    assert sorted(p.name for p in directory.iterdir()) == [
        "ca-key.pem",
        "ca.pem",
        "edge-a-key.pem",
        "edge-a.pem",
        "gw-key.pem",
        "gw.pem",
    ]


# --------------------------------------------------------------------------------------------------
# Issuing


def _check_leaf_basics(cert: x509.Certificate, ca_path: Path) -> None:
    ca = _cert(ca_path)
    assert cert.issuer == ca.subject
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ca_ski.digest
    cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    cert.verify_directly_issued_by(ca)
    skew = dt.datetime.now(dt.UTC) - cert.not_valid_before_utc
    assert dt.timedelta(minutes=4) < skew < dt.timedelta(minutes=6)


def test_issue_gateway(ca_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cert_path, key_path = pki.issue(
        ca_dir,
        out,
        "gateway",
        "gateway",
        dns_names=["gateway.example.com", "*.gw.example.com"],
        ip_addresses=["10.0.0.1", "fd00::1"],
        days=10,
    )
    assert cert_path == out / "gateway.pem" and key_path == out / "gateway-key.pem"
    # Only the leaf, not the CA, in the certificate file.
    assert cert_path.read_bytes().count(b"BEGIN CERTIFICATE") == 1

    cert = _cert(cert_path)
    _check_leaf_basics(cert, ca_dir / "ca.pem")
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]

    ident = pki.load_identity(cert_path)
    assert ident.role == "gateway"
    assert ident.common_name == "gateway"
    assert ident.dns_names == ("gateway.example.com", "*.gw.example.com")
    assert ident.ip_addresses == ("10.0.0.1", "fd00::1")
    assert ident.pools == ()
    assert ident.agent is None
    assert ident.issuer == "CN=Raven development CA"
    text = ident.describe()
    assert "gateway" in text and "gateway.example.com" in text and "fd00::1" in text and "valid" in text


def test_issue_gateway_defaults_dns_to_name(ca_dir: Path) -> None:
    cert_path, _ = pki.issue(ca_dir, ca_dir, "gateway", "gw.test", ip_addresses=["127.0.0.1"])
    ident = pki.load_identity(cert_path)
    assert ident.dns_names == ("gw.test",)
    assert ident.ip_addresses == ("127.0.0.1",)


def test_issue_agent(ca_dir: Path) -> None:
    cert_path, _ = pki.issue(ca_dir, ca_dir, "agent", "edge-a", pools=["pool-a", "pool-b", "pool-a"])
    cert = _cert(cert_path)
    _check_leaf_basics(cert, ca_dir / "ca.pem")
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier
    )
    assert uris == ["urn:raven:agent:edge-a", "urn:raven:pool:pool-a", "urn:raven:pool:pool-b"]

    ident = pki.load_identity(cert_path)
    assert ident.role == "agent"
    assert ident.agent == "edge-a"
    assert ident.common_name == "edge-a"
    assert ident.pools == ("pool-a", "pool-b")
    assert ident.dns_names == () and ident.ip_addresses == ()
    assert ident == pki.identity_from_der(cert.public_bytes(serialization.Encoding.DER))
    text = ident.describe()
    assert "agent" in text and "edge-a" in text and "pool-a, pool-b" in text


def test_agent_without_pool_is_refused(ca_dir: Path) -> None:
    with pytest.raises(pki.PKIError, match="at least one pool"):
        pki.issue(ca_dir, ca_dir, "agent", "edge-a")
    assert not (ca_dir / "edge-a.pem").exists()


@pytest.mark.parametrize(
    "pool", ["Pool-A", "pool_a", "-pool", "pool-", "a" * 64, "", "a.b", "pool a", "pööl"]
)
def test_invalid_pool_name_is_refused(ca_dir: Path, pool: str) -> None:
    with pytest.raises(pki.PKIError, match="invalid pool name") as info:
        pki.issue(ca_dir, ca_dir, "agent", "edge-a", pools=["good", pool])
    assert repr(pool) in str(info.value)
    assert not (ca_dir / "edge-a.pem").exists()


def test_longest_label_is_accepted(ca_dir: Path) -> None:
    cert_path, _ = pki.issue(ca_dir, ca_dir, "agent", "a" * 63, pools=["b" * 63, "0"])
    assert pki.load_identity(cert_path).pools == ("b" * 63, "0")


@pytest.mark.parametrize("name", ["Edge", "edge_a", "../edge", "edge/a", "", "a" * 64])
def test_invalid_agent_name_is_refused(ca_dir: Path, name: str) -> None:
    with pytest.raises(pki.PKIError, match="invalid agent name"):
        pki.issue(ca_dir, ca_dir, "agent", name, pools=["pool-a"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"role": "gateway", "name": "../gw"}, "invalid gateway name"),
        ({"role": "gateway", "name": "gw", "dns_names": ["bad name"]}, "invalid DNS name"),
        ({"role": "gateway", "name": "gw", "ip_addresses": ["10.0.0.300"]}, "invalid IP address"),
        ({"role": "gateway", "name": "gw", "pools": ["pool-a"]}, "agent certificates only"),
        ({"role": "agent", "name": "a", "pools": ["p"], "dns_names": ["x"]}, "gateway certificates only"),
        ({"role": "agent", "name": "a", "pools": "pool-a"}, "not a string"),
        ({"role": "admin", "name": "root"}, "unknown role"),
        ({"role": "gateway", "name": "gw", "days": 0}, "at least 1"),
        ({"role": "gateway", "name": "gw", "days": 4000}, "outlive the CA"),
        ({"role": "gateway", "name": "ca"}, "CA's own files"),
    ],
)
def test_bad_issue_requests_are_refused(ca_dir: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(pki.PKIError, match=message):
        pki.issue(ca_dir, ca_dir, **kwargs)  # type: ignore[arg-type]
    assert sorted(p.name for p in ca_dir.iterdir()) == ["ca-key.pem", "ca.pem"]


def test_issue_without_ca(tmp_path: Path) -> None:
    with pytest.raises(pki.PKIError, match="raven certs init"):
        pki.issue(tmp_path / "nowhere", tmp_path, "agent", "edge-a", pools=["pool-a"])


def test_issue_with_mismatched_ca_key(tmp_path: Path) -> None:
    pki.create_ca(tmp_path / "one")
    pki.create_ca(tmp_path / "two")
    shutil.copy(tmp_path / "two" / "ca-key.pem", tmp_path / "one" / "ca-key.pem")
    with pytest.raises(pki.PKIError, match="does not belong"):
        pki.issue(tmp_path / "one", tmp_path, "agent", "edge-a", pools=["pool-a"])


def test_issue_with_garbage_ca_files(ca_dir: Path) -> None:
    (ca_dir / "ca-key.pem").write_text("not a key")
    with pytest.raises(pki.PKIError, match="not a PEM private key"):
        pki.issue(ca_dir, ca_dir, "agent", "edge-a", pools=["pool-a"])
    (ca_dir / "ca.pem").write_text("not a cert")
    with pytest.raises(pki.PKIError, match="not a PEM certificate"):
        pki.issue(ca_dir, ca_dir, "agent", "edge-a", pools=["pool-a"])


def test_a_leaf_cannot_act_as_ca(ca_dir: Path, tmp_path: Path) -> None:
    pki.issue(ca_dir, ca_dir, "agent", "edge-a", pools=["pool-a"])
    fake = tmp_path / "fake"
    fake.mkdir()
    shutil.copy(ca_dir / "edge-a.pem", fake / "ca.pem")
    shutil.copy(ca_dir / "edge-a-key.pem", fake / "ca-key.pem")
    with pytest.raises(pki.PKIError, match="not a CA certificate"):
        pki.issue(fake, fake, "agent", "edge-b", pools=["pool-a"])


# --------------------------------------------------------------------------------------------------
# Reading


def test_reading_bad_input_raises_pki_error(ca_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(pki.PKIError, match="empty"):
        pki.identity_from_der(b"")
    with pytest.raises(pki.PKIError, match="not a valid DER certificate"):
        pki.identity_from_der(b"\x30\x03\x02\x01\x01")
    with pytest.raises(pki.PKIError, match="not found"):
        pki.load_identity(tmp_path / "missing.pem")
    with pytest.raises(pki.PKIError, match="private key, not a certificate"):
        pki.load_identity(ca_dir / "ca-key.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"\x00\x01 hello")
    with pytest.raises(pki.PKIError, match="contains no certificate"):
        pki.load_identity(garbage)
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(pki.PKIError, match="cannot parse"):
        pki.load_identity(broken)
    with pytest.raises(pki.PKIError, match="directory"):
        pki.load_identity(tmp_path)


def test_load_identity_reads_the_first_certificate_of_a_bundle(ca_dir: Path, tmp_path: Path) -> None:
    cert_path, _ = pki.issue(ca_dir, ca_dir, "agent", "edge-a", pools=["pool-a"])
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(cert_path.read_bytes() + (ca_dir / "ca.pem").read_bytes())
    assert pki.load_identity(bundle).agent == "edge-a"


@pytest.mark.parametrize(("agent", "pools", "cidrs", "says"), [
    ("evil\r\nX-Injected: yes", ["pool-a"], [], "agent name 'evil\\r\\nX-Injected: yes' is not an RFC 1123 name"),
    ("Edge_A", ["pool-a"], [], "agent name 'Edge_A'"),
    ("edge-a", ["pool-a", "pool-b\x1b[2J"], [], "pool 'pool-b\\x1b[2J' is not an RFC 1123 label"),
    ("edge-a", ["pool.a"], [], "pool 'pool.a'"),
    ("edge-a", ["pool-a"], ["10.0.0.1/8"], "layer-3 range '10.0.0.1/8' is not a CIDR"),
    ("edge-a.pool-a", ["pool-a"], ["10.0.0.0/8"], ""),
])
def test_names_problem_applies_the_node_name_rule_to_a_signed_certificate(
        ca_dir: Path, agent: str, pools: list[str], cidrs: list[str], says: str) -> None:
    """A CA signs what it is asked to: the names a signed agent certificate gives are checked by the rule node
    names follow before the gateway uses them (gateway/tunnel.py) or the agent starts with it."""
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(pki.AGENT_URI_PREFIX + agent)]
    sans += [x509.UniformResourceIdentifier(pki.POOL_URI_PREFIX + p) for p in pools]
    sans += [x509.UniformResourceIdentifier(pki.CIDR_URI_PREFIX + c) for c in cidrs]
    cert_path, _ = sign_leaf(ca_dir, ca_dir, "leaf", agent, sans, ExtendedKeyUsageOID.CLIENT_AUTH, days=2)
    ident = pki.load_identity(cert_path)
    assert ident.name == agent
    problem = ident.names_problem()
    assert (says in problem and problem) if says else problem == "", problem
    shown = ident.describe()  # `raven certs inspect`: one line per field, no control character
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f]", shown) and len(shown.splitlines()) == 11 + bool(cidrs), shown


def test_describe_reports_validity(ca_dir: Path) -> None:
    cert_path, _ = pki.issue(ca_dir, ca_dir, "agent", "edge-a", pools=["pool-a"], days=10)
    ident = pki.load_identity(cert_path)
    now = dt.datetime.now(dt.UTC)
    assert ident.is_valid_at(now)
    assert "valid (" in ident.describe(now)
    assert "EXPIRED" in ident.describe(now + dt.timedelta(days=11))
    assert not ident.is_valid_at(now + dt.timedelta(days=11))
    assert "NOT YET VALID" in ident.describe(now - dt.timedelta(hours=1))


# --------------------------------------------------------------------------------------------------
# Real TLS 1.3 with mutual authentication


@dataclass
class _Pki:
    ca: Path
    gateway: tuple[Path, Path]
    agent: tuple[Path, Path]


def _make_pki(directory: Path) -> _Pki:
    pki.create_ca(directory)
    gateway = pki.issue(directory, directory, "gateway", "gw.test", ip_addresses=["127.0.0.1"])
    agent = pki.issue(directory, directory, "agent", "edge-a", pools=["pool-a", "pool-b"])
    return _Pki(directory / "ca.pem", gateway, agent)


def _server_context(ca: Path, cert: tuple[Path, Path]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(*cert)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(ca)
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx


def _client_context(ca: Path, cert: tuple[Path, Path]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(ca)
    ctx.load_cert_chain(*cert)
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx


@dataclass
class _Outcome:
    server_error: BaseException | None = None
    client_error: BaseException | None = None
    peer_der: bytes | None = None
    version: str | None = None

    @property
    def ok(self) -> bool:
        return self.server_error is None and self.client_error is None


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str) -> _Outcome:
    outcome = _Outcome()
    server_sock, client_sock = socket.socketpair()
    server_sock.settimeout(10)
    client_sock.settimeout(10)

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(server_sock, server_side=True) as tls:
                outcome.peer_der = tls.getpeercert(binary_form=True)
                outcome.version = tls.version()
                tls.sendall(b"ok")
        except Exception as exc:
            outcome.server_error = exc
        finally:
            server_sock.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with client_ctx.wrap_socket(client_sock, server_hostname=server_hostname) as tls:
            # In TLS 1.3 the server checks the client certificate after the client finished its side of
            # the handshake: a rejection shows up on the first read.
            if tls.recv(2) != b"ok":
                raise ConnectionError("connection closed by the server")
    except Exception as exc:
        outcome.client_error = exc
    finally:
        client_sock.close()
    thread.join(10)
    assert not thread.is_alive()
    return outcome


@pytest.mark.parametrize("server_hostname", ["gw.test", "127.0.0.1"])
def test_mutual_tls_handshake_succeeds(tmp_path: Path, server_hostname: str) -> None:
    p = _make_pki(tmp_path)
    outcome = _handshake(
        _server_context(p.ca, p.gateway), _client_context(p.ca, p.agent), server_hostname=server_hostname
    )
    assert outcome.ok, (outcome.server_error, outcome.client_error)
    assert outcome.version == "TLSv1.3"
    assert outcome.peer_der is not None
    # What the gateway learns about the agent from its certificate.
    peer = pki.identity_from_der(outcome.peer_der)
    assert peer.role == "agent" and peer.agent == "edge-a" and peer.pools == ("pool-a", "pool-b")


def test_gateway_certificate_from_another_ca_is_rejected(tmp_path: Path) -> None:
    good = _make_pki(tmp_path / "good")
    evil = _make_pki(tmp_path / "evil")
    outcome = _handshake(
        _server_context(good.ca, evil.gateway),
        _client_context(good.ca, good.agent),
        server_hostname="gw.test",
    )
    assert isinstance(outcome.client_error, ssl.SSLCertVerificationError)
    assert outcome.server_error is not None


def test_agent_certificate_from_another_ca_is_rejected(tmp_path: Path) -> None:
    good = _make_pki(tmp_path / "good")
    evil = _make_pki(tmp_path / "evil")
    outcome = _handshake(
        _server_context(good.ca, good.gateway),
        _client_context(good.ca, evil.agent),
        server_hostname="gw.test",
    )
    assert isinstance(outcome.server_error, ssl.SSLError)
    assert outcome.client_error is not None
    assert outcome.peer_der is None


def test_wrong_gateway_name_is_rejected(tmp_path: Path) -> None:
    p = _make_pki(tmp_path)
    outcome = _handshake(
        _server_context(p.ca, p.gateway), _client_context(p.ca, p.agent), server_hostname="other.test"
    )
    assert isinstance(outcome.client_error, ssl.SSLCertVerificationError)


def test_agent_certificate_cannot_serve_as_gateway(tmp_path: Path) -> None:
    p = _make_pki(tmp_path)
    pki.issue(tmp_path, tmp_path, "agent", "gw-test", pools=["pool-a"])
    outcome = _handshake(
        _server_context(p.ca, (tmp_path / "gw-test.pem", tmp_path / "gw-test-key.pem")),
        _client_context(p.ca, p.agent),
        server_hostname="gw-test",
    )
    assert isinstance(outcome.client_error, ssl.SSLCertVerificationError)


# --------------------------------------------------------------------------------------------------
# raven certs


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="raven")
    add_parser_target = parser.add_subparsers()
    certs.add_parser(add_parser_target)
    args = parser.parse_args(list(argv))
    result = args.func(args)
    assert isinstance(result, int)
    return result


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "dev")
    assert _run("certs", "init", "--dir", d, "--cn", "CLI CA", "--days", "100") == 0
    out = capsys.readouterr().out
    assert "ca.pem" in out and "ca-key.pem" in out and "CLI CA" in out
    assert _mode(Path(d) / "ca-key.pem") == 0o600

    assert _run("certs", "init", "--dir", d) == 1
    err = capsys.readouterr().err
    assert err.startswith("raven certs: error: ") and "--force" in err and "Traceback" not in err
    assert _run("certs", "init", "--dir", d, "--force", "--cn", "CLI CA") == 0
    capsys.readouterr()

    rc = _run("certs", "issue", "gateway", "gw", "--dir", d, "--dns", "gw.example.com", "--ip", "10.1.2.3")
    assert rc == 0
    out = capsys.readouterr().out
    assert "gw.pem" in out and "gw-key.pem" in out and "gw.example.com" in out and "10.1.2.3" in out
    gw = pki.load_identity(Path(d) / "gw.pem")
    assert gw.role == "gateway" and gw.dns_names == ("gw.example.com",) and gw.ip_addresses == ("10.1.2.3",)

    rc = _run("certs", "issue", "agent", "edge-a", "--pool", "pool-a", "--pool", "pool-b", "--dir", d)
    assert rc == 0
    out = capsys.readouterr().out
    assert "edge-a.pem" in out and "pool-a" in out

    assert _run("certs", "show", str(Path(d) / "edge-a.pem")) == 0
    out = capsys.readouterr().out
    assert "pool-a" in out and "pool-b" in out and "edge-a" in out and "agent" in out


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("certs", "show", str(tmp_path / "missing.pem")) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("raven certs: error: ") and "missing.pem" in captured.err

    d = str(tmp_path / "dev")
    assert _run("certs", "issue", "agent", "edge-a", "--pool", "pool-a", "--dir", d) == 1
    assert "raven certs init" in capsys.readouterr().err

    assert _run("certs", "init", "--dir", d) == 0
    capsys.readouterr()
    assert _run("certs", "issue", "agent", "edge-a", "--pool", "Bad_Pool", "--dir", d) == 1
    assert "'Bad_Pool'" in capsys.readouterr().err


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _run("certs", "issue", "agent", "edge-a")
    assert info.value.code == 2
    assert "--pool" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _run("certs", "init", "--days", "0")
    assert _run("certs") == 2
    assert "init" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ("certs",),
        ("certs", "init"),
        ("certs", "issue"),
        ("certs", "issue", "gateway"),
        ("certs", "issue", "agent"),
        ("certs", "show"),
    ],
)
def test_cli_help(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _run(*argv, "--help")
    assert info.value.code == 0
    assert len(capsys.readouterr().out.splitlines()) > 5
