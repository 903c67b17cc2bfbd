"""The certificate authority: make a CA (:func:`create_ca`) and issue gateway and agent certificates
(:func:`issue`), with every name, pool and CIDR checked first.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from pathlib import Path
from typing import TypeAlias

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from raven.errors import PKIError
from raven.names import MAX_NAME, valid_label
from raven.pki.common import (
    AGENT_URI_PREFIX,
    CA_CERT_FILE,
    CA_KEY_FILE,
    CIDR_URI_PREFIX,
    CLOCK_SKEW,
    POOL_URI_PREFIX,
    ROLES,
    dedupe,
    fmt_time,
    key_pem,
    make_dir,
    read_file,
    write_file,
)

# --------------------------------------------------------------------------------------------------
# Validation


def _check_label(kind: str, value: str) -> str:
    if not isinstance(value, str) or not valid_label(value):
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
    ok = 0 < len(value) <= MAX_NAME and all(map(valid_label, labels))
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
    make_dir(directory)

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
    write_file(key_path, key_pem(key), 0o600)
    write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


_IssuerKey: TypeAlias = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, _IssuerKey, Path, Path]:
    cert_path = ca_dir / CA_CERT_FILE
    key_path = ca_dir / CA_KEY_FILE
    hint = f"; create a CA first with 'raven certs init --dir {ca_dir}'"
    cert_data = read_file(cert_path, "CA certificate", hint)
    key_data = read_file(key_path, "CA private key", hint)
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
            f"CA certificate {cert_path} expired at {fmt_time(cert.not_valid_after_utc)}; "
            f"create a new CA with 'raven certs init --dir {ca_dir} --force' and re-issue all certificates"
        )
    if now < cert.not_valid_before_utc:
        raise PKIError(
            f"CA certificate {cert_path} is not valid until {fmt_time(cert.not_valid_before_utc)}; "
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
        dns = dedupe(_check_dns_name("DNS name", d, allow_wildcard=True) for d in dns_names) or [name]
        ips = dedupe(str(_check_ip(ip)) for ip in ip_addresses)
        sans.extend(x509.DNSName(d) for d in dns)
        sans.extend(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips)
        eku = ExtendedKeyUsageOID.SERVER_AUTH
    elif role == "agent":
        _check_label("agent name", name)
        if dns_names or ip_addresses:
            raise PKIError("DNS names and IP addresses apply to gateway certificates only")
        checked = dedupe(_check_label("pool name", p) for p in pools)
        if not checked:
            raise PKIError(
                f"agent {name!r} needs at least one pool (--pool POOL): the pools listed in its "
                "certificate are the only ones the gateway lets it serve"
            )
        sans.append(x509.UniformResourceIdentifier(AGENT_URI_PREFIX + name))
        sans.extend(x509.UniformResourceIdentifier(POOL_URI_PREFIX + p) for p in checked)
        sans.extend(x509.UniformResourceIdentifier(CIDR_URI_PREFIX + c) for c in dedupe(_check_cidr(c) for c in cidrs))
        eku = ExtendedKeyUsageOID.CLIENT_AUTH
    else:
        raise PKIError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    return sign_leaf(ca_dir, out_dir, name, name, sans, eku, days)


def sign_leaf(
    ca_dir: Path, out_dir: Path, file_name: str, common_name: str, sans: Sequence[x509.GeneralName],
    eku: x509.ObjectIdentifier, days: int,
) -> tuple[Path, Path]:
    """Sign a leaf certificate with the CA in ``ca_dir`` as given, and write ``<file_name>.pem`` and
    ``<file_name>-key.pem``. Its names are not checked here (:func:`issue` checks them first): tests use it to make
    what another CA may sign, e.g. an agent name with a CR LF, which the gateway must refuse."""
    ca_dir = Path(ca_dir)
    out_dir = Path(out_dir)
    _check_days(days)
    ca_cert, ca_key, ca_cert_path, ca_key_path = _load_ca(ca_dir)
    cert_path = out_dir / f"{file_name}.pem"
    key_path = out_dir / f"{file_name}-key.pem"
    ca_files = {ca_cert_path.resolve(), ca_key_path.resolve()}
    if cert_path.resolve() in ca_files or key_path.resolve() in ca_files:
        raise PKIError(f"name {file_name!r} would overwrite the CA's own files in {out_dir}; choose another name")

    now = _now()
    not_after = now + dt.timedelta(days=days)
    if not_after > ca_cert.not_valid_after_utc:
        left = (ca_cert.not_valid_after_utc - now).days
        raise PKIError(
            f"a {days}-day certificate would outlive the CA, which expires at "
            f"{fmt_time(ca_cert.not_valid_after_utc)}; use at most {left} days or create a new CA"
        )

    try:
        ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    except (x509.ExtensionNotFound, ValueError, x509.DuplicateExtension):
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
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
    make_dir(out_dir)
    write_file(key_path, key_pem(key), 0o600)
    write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path
