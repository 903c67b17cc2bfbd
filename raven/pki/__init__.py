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

The parts: ``common`` (the certificate model's constants, name rules and files), ``authority`` (making a CA,
issuing), ``identity`` (reading certificates back). Their public names are re-exported here.
"""

from __future__ import annotations

from raven.errors import PKIError
from raven.pki.authority import create_ca, issue
from raven.pki.common import AGENT_URI_PREFIX, CA_CERT_FILE, CA_KEY_FILE, CIDR_URI_PREFIX, POOL_URI_PREFIX, ROLES
from raven.pki.identity import Identity, identity_from_der, load_identity

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
