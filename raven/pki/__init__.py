"""Raven's certificate authority: make a CA, issue gateway and agent certificates, read them back.

Raven uses TLS 1.3 with mutual authentication between agents and the gateway. Every key is ECDSA P-256
and every signature SHA-256. Certificates carry Raven's authorization data in URI subject alternative
names:

* ``urn:raven:agent:<name>`` names the agent the certificate belongs to;
* ``urn:raven:pool:<pool>`` (one per pool) lists the edge pools the agent may serve. The gateway
  refuses registrations of nodes outside these pools.
* ``urn:raven:cidr:<cidr>`` (layer 3, optional, one per range) lists the IP ranges the agent may announce for
  its pools; the gateway routes to a pool only ranges that both its configuration and the certificate allow.

A gateway certificate is an ordinary TLS server certificate (serverAuth) valid for DNS names and IP
addresses. An agent certificate is a TLS client certificate (clientAuth).

Every failure caused by input (a missing file, a key that does not match, a bad name, an expired CA)
is reported as :class:`PKIError` with a message an operator can act on.

Why this module is long and not split: the CA, issuing and inspecting share the certificate model (names,
pools, roles, key usages); splitting them would spread one contract over three files.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from raven.errors import PKIError

__all__ = [
    "AGENT_URI_PREFIX",
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "CIDR_URI_PREFIX",
    "POOL_URI_PREFIX",
    "ROLES",
    "Identity",
    "PKIError",
    "create_ca",
    "identity_from_der",
    "issue",
    "load_identity",
]

POOL_URI_PREFIX = "urn:raven:pool:"
CIDR_URI_PREFIX = "urn:raven:cidr:"
AGENT_URI_PREFIX = "urn:raven:agent:"

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"

#: Roles that :func:`issue` can issue certificates for.
ROLES = ("gateway", "agent")

#: Leaf certificates start this long before "now" so that peers with a slow clock accept them.
CLOCK_SKEW = dt.timedelta(minutes=5)

_LABEL_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_MAX_DNS_NAME = 253


@dataclass(frozen=True)
class Identity:
    """What a certificate says about its holder, in Raven's terms."""

    common_name: str
    role: str  # "gateway", "agent", "ca" or "unknown"
    pools: tuple[str, ...]
    agent: str | None
    dns_names: tuple[str, ...]
    ip_addresses: tuple[str, ...]
    serial: int
    not_before: dt.datetime
    not_after: dt.datetime
    issuer: str
    fingerprint_sha256: str
    cidrs: tuple[str, ...] = ()  # layer 3: ranges the agent may announce (urn:raven:cidr:)

    def is_valid_at(self, when: dt.datetime) -> bool:
        """True if ``when`` (timezone-aware) lies inside the certificate's validity window."""
        return self.not_before <= when <= self.not_after

    def describe(self, now: dt.datetime | None = None) -> str:
        """A multi-line summary of what this certificate allows, for people."""
        if now is None:
            now = dt.datetime.now(dt.UTC)
        lines = [f"Certificate for {self.common_name or '(no common name)'}"]
        role_text = {
            "gateway": "gateway (TLS server: agents and clients may connect to it)",
            "agent": "agent (TLS client: may connect to the gateway and serve edge pools)",
            "ca": "certificate authority (signs gateway and agent certificates)",
        }.get(self.role, f"{self.role} (no serverAuth/clientAuth usage: Raven will not accept it)")
        lines.append(f"  Role:          {role_text}")
        if self.agent is not None or self.role == "agent":
            agent = self.agent or f"(none: certificate has no {AGENT_URI_PREFIX} URI)"
            lines.append(f"  Agent name:    {agent}")
        if self.pools:
            lines.append(f"  May serve:     {', '.join(self.pools)}")
            lines.append("                 (the gateway refuses registrations of nodes outside these pools)")
        elif self.role == "agent":
            lines.append("  May serve:     no pools (the gateway will refuse every node registration)")
        if self.cidrs:
            lines.append(f"  Layer 3:       may announce {', '.join(self.cidrs)}")
        if self.dns_names or self.ip_addresses or self.role == "gateway":
            names = [*self.dns_names, *self.ip_addresses]
            valid_for = ", ".join(names) if names else "(no DNS names or IP addresses)"
            lines.append(f"  Valid for:     {valid_for}")
        lines.append(f"  Not before:    {_fmt_time(self.not_before)}")
        lines.append(f"  Not after:     {_fmt_time(self.not_after)}")
        lines.append(f"  Status:        {self._status(now)}")
        lines.append(f"  Issuer:        {self.issuer}")
        lines.append(f"  Serial:        {self.serial:x}")
        lines.append(f"  SHA-256:       {self.fingerprint_sha256}")
        return "\n".join(lines)

    def _status(self, now: dt.datetime) -> str:
        if now < self.not_before:
            return f"NOT YET VALID (starts in {_fmt_delta(self.not_before - now)})"
        if now > self.not_after:
            return f"EXPIRED ({_fmt_delta(now - self.not_after)} ago)"
        return f"valid ({_fmt_delta(self.not_after - now)} left)"


def _fmt_time(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt_delta(delta: dt.timedelta) -> str:
    if delta.days >= 2:
        return f"{delta.days} days"
    hours = int(delta.total_seconds() // 3600)
    if hours >= 1:
        return f"{hours} hours"
    return f"{max(int(delta.total_seconds() // 60), 0)} minutes"


# --------------------------------------------------------------------------------------------------
# Validation


def _check_label(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _LABEL_RE.fullmatch(value):
        raise PKIError(
            f"invalid {kind} {value!r}: must be an RFC 1123 label (1-63 characters: lowercase letters, "
            "digits and '-', starting and ending with a letter or digit)"
        )
    return value


def _check_dns_name(kind: str, value: str, *, allow_wildcard: bool) -> str:
    if not isinstance(value, str):
        raise PKIError(f"invalid {kind} {value!r}: must be a string")
    labels = value.split(".")
    if allow_wildcard and len(labels) > 1 and labels[0] == "*":
        labels = labels[1:]
    ok = 0 < len(value) <= _MAX_DNS_NAME and all(_LABEL_RE.fullmatch(label) for label in labels)
    if not ok:
        raise PKIError(
            f"invalid {kind} {value!r}: must be a lowercase DNS name such as 'gateway.example.com' "
            "(labels of letters, digits and '-', separated by dots)"
        )
    return value


def _check_ip(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        raise PKIError(f"invalid IP address {value!r}: expected e.g. 10.0.0.1 or fd00::1") from None


def _check_days(days: int) -> int:
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise PKIError(f"invalid validity {days!r} days: must be a whole number of at least 1")
    return days


def _dedupe(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


# --------------------------------------------------------------------------------------------------
# Files


def _make_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise PKIError(f"cannot create directory {directory}: {exc.strerror or exc}") from exc
    if not directory.is_dir():
        raise PKIError(f"{directory} exists and is not a directory")


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` atomically; the file is created with ``mode`` from the start."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise PKIError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _read(path: Path, what: str, hint: str = "") -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PKIError(f"{what} {path} not found{hint}") from None
    except IsADirectoryError:
        raise PKIError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise PKIError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


# --------------------------------------------------------------------------------------------------
# CA


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def create_ca(
    directory: Path,
    common_name: str = "Raven development CA",
    days: int = 3650,
    overwrite: bool = False,
) -> tuple[Path, Path]:
    """Create a new CA in ``directory``; return the paths of ``ca.pem`` and ``ca-key.pem``.

    Refuses to replace an existing CA unless ``overwrite`` is true: every certificate issued by the old
    CA stops being trusted once peers load the new one.
    """
    directory = Path(directory)
    _check_days(days)
    if not isinstance(common_name, str) or not common_name.strip():
        raise PKIError("the CA common name must not be empty")
    cert_path = directory / CA_CERT_FILE
    key_path = directory / CA_KEY_FILE
    if not overwrite:
        existing = [str(p) for p in (cert_path, key_path) if p.exists() or p.is_symlink()]
        if existing:
            raise PKIError(
                f"a CA already exists ({', '.join(existing)}); refusing to overwrite it. Replacing it "
                "('raven certs init --force') means no certificate issued by the old CA is trusted any more"
            )
    _make_dir(directory)

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    # Key first: a certificate without its key is useless, a stale certificate next to a new key is
    # caught by issue()'s key check.
    _write_file(key_path, _key_pem(key), 0o600)
    _write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


_IssuerKey: TypeAlias = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, _IssuerKey, Path, Path]:
    cert_path = ca_dir / CA_CERT_FILE
    key_path = ca_dir / CA_KEY_FILE
    hint = f"; create a CA first with 'raven certs init --dir {ca_dir}'"
    cert_data = _read(cert_path, "CA certificate", hint)
    key_data = _read(key_path, "CA private key", hint)
    try:
        cert = x509.load_pem_x509_certificate(cert_data)
    except ValueError as exc:
        raise PKIError(f"{cert_path} is not a PEM certificate ({exc})") from None
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except TypeError:
        raise PKIError(f"{key_path} is encrypted; Raven needs an unencrypted CA key") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise PKIError(f"{key_path} is not a PEM private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise PKIError(f"{key_path}: unsupported CA key type {type(key).__name__}; use an ECDSA or RSA key")
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if key.public_key().public_bytes(der, pub) != cert.public_key().public_bytes(der, pub):
        raise PKIError(
            f"{key_path} does not belong to {cert_path} (the key does not match the certificate); "
            "restore the matching pair or create a new CA"
        )
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        is_ca = bc.ca
    except x509.ExtensionNotFound:
        is_ca = False
    except (ValueError, x509.DuplicateExtension) as exc:
        raise PKIError(f"{cert_path} has malformed extensions ({exc})") from None
    if not is_ca:
        raise PKIError(f"{cert_path} is not a CA certificate (BasicConstraints ca=TRUE missing)")
    now = dt.datetime.now(dt.UTC)
    if now > cert.not_valid_after_utc:
        raise PKIError(
            f"CA certificate {cert_path} expired at {_fmt_time(cert.not_valid_after_utc)}; "
            f"create a new CA with 'raven certs init --dir {ca_dir} --force' and re-issue all certificates"
        )
    if now < cert.not_valid_before_utc:
        raise PKIError(
            f"CA certificate {cert_path} is not valid until {_fmt_time(cert.not_valid_before_utc)}; "
            "check this machine's clock"
        )
    return cert, key, cert_path, key_path


# --------------------------------------------------------------------------------------------------
# Leaf certificates


def _check_cidr(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except ValueError:
        raise PKIError(f"{value!r} is not a CIDR without host bits (e.g. 10.20.0.0/16)") from None


def issue(
    ca_dir: Path,
    out_dir: Path,
    role: str,
    name: str,
    *,
    pools: Sequence[str] = (),
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
    cidrs: Sequence[str] = (),
    days: int = 365,
) -> tuple[Path, Path]:
    """Issue a gateway or agent certificate signed by the CA in ``ca_dir``.

    Writes ``<name>.pem`` (the leaf certificate only) and ``<name>-key.pem`` (mode 0600) into
    ``out_dir``, replacing earlier files of the same name atomically, and returns their paths.
    """
    ca_dir = Path(ca_dir)
    out_dir = Path(out_dir)
    _check_days(days)
    if isinstance(pools, str) or isinstance(dns_names, str) or isinstance(ip_addresses, str):
        raise PKIError("pools, dns_names and ip_addresses must be sequences of strings, not a string")

    sans: list[x509.GeneralName] = []
    if role == "gateway":
        _check_dns_name("gateway name", name, allow_wildcard=False)
        if pools or cidrs:
            raise PKIError("pools and CIDRs apply to agent certificates only; a gateway certificate has none")
        dns = _dedupe(_check_dns_name("DNS name", d, allow_wildcard=True) for d in dns_names) or [name]
        ips = _dedupe(str(_check_ip(ip)) for ip in ip_addresses)
        sans.extend(x509.DNSName(d) for d in dns)
        sans.extend(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips)
        eku = ExtendedKeyUsageOID.SERVER_AUTH
    elif role == "agent":
        _check_label("agent name", name)
        if dns_names or ip_addresses:
            raise PKIError("DNS names and IP addresses apply to gateway certificates only")
        checked = _dedupe(_check_label("pool name", p) for p in pools)
        if not checked:
            raise PKIError(
                f"agent {name!r} needs at least one pool (--pool POOL): the pools listed in its "
                "certificate are the only ones the gateway lets it serve"
            )
        sans.append(x509.UniformResourceIdentifier(AGENT_URI_PREFIX + name))
        sans.extend(x509.UniformResourceIdentifier(POOL_URI_PREFIX + p) for p in checked)
        sans.extend(x509.UniformResourceIdentifier(CIDR_URI_PREFIX + c) for c in _dedupe(_check_cidr(c) for c in cidrs))
        eku = ExtendedKeyUsageOID.CLIENT_AUTH
    else:
        raise PKIError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")

    ca_cert, ca_key, ca_cert_path, ca_key_path = _load_ca(ca_dir)
    cert_path = out_dir / f"{name}.pem"
    key_path = out_dir / f"{name}-key.pem"
    ca_files = {ca_cert_path.resolve(), ca_key_path.resolve()}
    if cert_path.resolve() in ca_files or key_path.resolve() in ca_files:
        raise PKIError(f"name {name!r} would overwrite the CA's own files in {out_dir}; choose another name")

    now = _now()
    not_after = now + dt.timedelta(days=days)
    if not_after > ca_cert.not_valid_after_utc:
        left = (ca_cert.not_valid_after_utc - now).days
        raise PKIError(
            f"a {days}-day certificate would outlive the CA, which expires at "
            f"{_fmt_time(ca_cert.not_valid_after_utc)}; use at most {left} days or create a new CA"
        )

    try:
        ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    except (x509.ExtensionNotFound, ValueError, x509.DuplicateExtension):
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(aki, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _make_dir(out_dir)
    _write_file(key_path, _key_pem(key), 0o600)
    _write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


# --------------------------------------------------------------------------------------------------
# Reading certificates


def _common_name(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not attrs:
        return ""
    value = attrs[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


def _identity(cert: x509.Certificate) -> Identity:
    exts = cert.extensions
    try:
        is_ca = exts.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    try:
        usages = list(exts.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        usages = []
    try:
        san = exts.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
        dns = tuple(san.get_values_for_type(x509.DNSName))
        ips = tuple(str(ip) for ip in san.get_values_for_type(x509.IPAddress))
    except x509.ExtensionNotFound:
        uris, dns, ips = [], (), ()

    if is_ca:
        role = "ca"
    elif ExtendedKeyUsageOID.SERVER_AUTH in usages:
        role = "gateway"
    elif ExtendedKeyUsageOID.CLIENT_AUTH in usages:
        role = "agent"
    else:
        role = "unknown"

    pools = tuple(_dedupe(u[len(POOL_URI_PREFIX) :] for u in uris if u.startswith(POOL_URI_PREFIX)))
    agents = [u[len(AGENT_URI_PREFIX) :] for u in uris if u.startswith(AGENT_URI_PREFIX)]
    cidrs = tuple(_dedupe(u[len(CIDR_URI_PREFIX) :] for u in uris if u.startswith(CIDR_URI_PREFIX)))
    return Identity(
        common_name=_common_name(cert),
        role=role,
        pools=pools,
        agent=agents[0] if agents else None,
        dns_names=dns,
        ip_addresses=ips,
        serial=cert.serial_number,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        issuer=cert.issuer.rfc4514_string(),
        fingerprint_sha256=cert.fingerprint(hashes.SHA256()).hex(),
        cidrs=cidrs,
    )


_PARSE_ERRORS = (
    ValueError,
    TypeError,
    x509.DuplicateExtension,
    x509.UnsupportedGeneralNameType,
    x509.InvalidVersion,
)


def identity_from_der(der: bytes) -> Identity:
    """Parse a DER certificate (e.g. ``SSLSocket.getpeercert(binary_form=True)``) into an Identity."""
    if not der:
        raise PKIError("no certificate (empty input)")
    try:
        return _identity(x509.load_der_x509_certificate(bytes(der)))
    except _PARSE_ERRORS as exc:
        raise PKIError(f"not a valid DER certificate: {exc}") from None


def load_identity(path: Path) -> Identity:
    """Read the first certificate of a PEM file (DER is accepted too) and return its Identity."""
    path = Path(path)
    data = _read(path, "certificate file")
    if b"-----BEGIN" not in data:
        try:
            return identity_from_der(data)
        except PKIError:
            raise PKIError(f"{path} contains no certificate (expected a PEM or DER file)") from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        if b"PRIVATE KEY-----" in data:
            raise PKIError(f"{path} is a private key, not a certificate; pass the matching .pem file instead")
        raise PKIError(f"{path} contains no PEM certificate (no '-----BEGIN CERTIFICATE-----' block)")
    try:
        certs = x509.load_pem_x509_certificates(data)
        return _identity(certs[0])
    except _PARSE_ERRORS as exc:
        raise PKIError(f"{path}: cannot parse certificate ({exc})") from None
