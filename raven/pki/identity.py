"""Reading certificates back: who a certificate is for (:class:`Identity`: role, agent, pools, CIDRs, validity),
from a PEM or DER file or the bytes a TLS peer presented.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from raven.errors import PKIError
from raven.logsafe import escape
from raven.pki.common import AGENT_URI_PREFIX, CIDR_URI_PREFIX, POOL_URI_PREFIX, dedupe, fmt_delta, fmt_time, read_file
from raven.protocol.wire import valid_node_name, valid_pool_name


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

    @property
    def name(self) -> str:
        """The agent's name: its ``urn:raven:agent:`` URI, else the common name."""
        return self.agent or self.common_name

    def names_problem(self) -> str:
        """Why the names an agent certificate gives its holder cannot be used ("" when they can).

        A CA signs what it is asked to (cert-manager, another team's CA), so a CA-signed name is still checked by
        the rule node names follow: the agent's name is an RFC 1123 name, each pool an RFC 1123 label, each CIDR
        a CIDR. They go into answers' headers (``X-Raven-Agent``), metric labels, logs and ``raven status``, so a
        name with a CR LF or a terminal escape must never get a session."""
        if not valid_node_name(self.name):
            return (f"the certificate's agent name {self.name[:80]!r} is not an RFC 1123 name (lower-case letters, "
                    "digits, '-' and '.', at most 253 characters)")
        bad = [p for p in self.pools if not valid_pool_name(p)]
        if bad:
            return f"the certificate's pool {bad[0][:80]!r} is not an RFC 1123 label (at most 63 characters)"
        for cidr in self.cidrs:
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError:
                return f"the certificate's layer-3 range {cidr[:80]!r} is not a CIDR without host bits"
        return ""

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
        lines.append(f"  Not before:    {fmt_time(self.not_before)}")
        lines.append(f"  Not after:     {fmt_time(self.not_after)}")
        lines.append(f"  Status:        {self._status(now)}")
        lines.append(f"  Issuer:        {self.issuer}")
        lines.append(f"  Serial:        {self.serial:x}")
        lines.append(f"  SHA-256:       {self.fingerprint_sha256}")
        return "\n".join(escape(line) for line in lines)  # a certificate's names are whatever its CA signed

    def _status(self, now: dt.datetime) -> str:
        if now < self.not_before:
            return f"NOT YET VALID (starts in {fmt_delta(self.not_before - now)})"
        if now > self.not_after:
            return f"EXPIRED ({fmt_delta(now - self.not_after)} ago)"
        return f"valid ({fmt_delta(self.not_after - now)} left)"


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

    pools = tuple(dedupe(u[len(POOL_URI_PREFIX) :] for u in uris if u.startswith(POOL_URI_PREFIX)))
    agents = [u[len(AGENT_URI_PREFIX) :] for u in uris if u.startswith(AGENT_URI_PREFIX)]
    cidrs = tuple(dedupe(u[len(CIDR_URI_PREFIX) :] for u in uris if u.startswith(CIDR_URI_PREFIX)))
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
    data = read_file(path, "certificate file")
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
