"""Which node names may reach DNS: names as Kubernetes allows them, minus the names that belong to the cluster.

The hosts file Raven publishes is served by CoreDNS to the whole cluster, so a name in it shadows whatever that
name meant before. An agent (or a Node object) may therefore only publish a name that

- is a valid node name: RFC 1123, lower case, labels of at most 63 characters, at most 253 in all (most node
  names are single labels such as ``edge-gpu-7``; those always pass the rest of the rule unless denied);
- is not on the deny list: the cluster's and the host's own names (``localhost``, ``kubernetes``, ``kube-dns``,
  ``coredns``, ``metadata``, ``prometheus``, the gateway's Service names ...), by default and as configured;
- does not end in a denied suffix: the cluster domain (``cluster.local`` by default, and ``.svc``), ``.local``,
  ``.localhost``, ``.internal.cluster``, and any configured;
- does not read as an IP address to a resolver or a C library: a name whose last label is all digits
  (``2130706433``, ``10.0.0.1``) or that ``inet_aton`` takes for an address (``0x7f000001``).

:class:`NameRule` answers with a :class:`~raven.refusals.Refusal` (a reason code, whose label the registry's
metric takes, and a text for people), or None for a name that may be published. Pure: no I/O.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable

from raven.protocol.wire import valid_node_name
from raven.refusals import Reason, Refusal

# Names that belong to the host, the cluster, cloud metadata services, the monitoring stack and Raven itself.
DEFAULT_DENIED_NAMES: tuple[str, ...] = (
    "localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", "broadcasthost", "wpad",
    "kubernetes", "kubernetes.default", "kube-apiserver", "kube-dns", "kube-proxy", "coredns", "etcd",
    "metadata", "metadata.google.internal", "instance-data", "instance-data.ec2.internal",
    "prometheus", "alertmanager", "grafana", "pushgateway",
    "raven", "raven-gateway", "raven-gateway-tunnel", "raven-agent",
)
DEFAULT_DENIED_SUFFIXES: tuple[str, ...] = (".svc", ".local", ".localhost", ".internal.cluster")
DEFAULT_CLUSTER_DOMAIN = "cluster.local"

# Every valid node name that reads_as_address may take for an address: all-digit last label, or nothing but the
# characters inet_aton reads (digits, hex digits, 'x', dots; a valid name has no upper case and no space).
_MAY_READ_AS_ADDRESS = re.compile(r"[0-9a-fx.]+\Z|.*\.[0-9]+\Z")


def reads_as_address(name: str) -> bool:
    """A name a resolver or ``inet_aton`` may take for an IPv4 address (all-digit last label, hex or octal forms)."""
    if name.rsplit(".", 1)[-1].isdigit():
        return True
    try:
        socket.inet_aton(name)
    except (OSError, ValueError):
        return False
    return True


class NameRule:
    """The stated rule for names that reach DNS; built from the gateway's configuration."""

    def __init__(
        self,
        denied_names: Iterable[str] = DEFAULT_DENIED_NAMES,
        denied_suffixes: Iterable[str] = DEFAULT_DENIED_SUFFIXES,
        cluster_domain: str = DEFAULT_CLUSTER_DOMAIN,
    ) -> None:
        self.denied_names = frozenset(n.lower().rstrip(".") for n in denied_names)
        suffixes = {"." + s.lower().strip(".") for s in denied_suffixes if s.strip(".")}
        domain = cluster_domain.lower().strip(".")
        if domain:
            suffixes.add("." + domain)
            self.denied_names |= {domain}
        self.denied_suffixes = tuple(sorted(suffixes))

    def refusal(self, name: str) -> Refusal | None:
        if not valid_node_name(name):
            return Refusal(Reason.INVALID_NAME, "not a valid RFC 1123 node name (lower case letters, digits, '-' "
                           "and '.', labels of 1-63 characters, at most 253 in all)", node=name[:253])
        if name in self.denied_names:
            return Refusal(Reason.RESERVED_NAME, "reserved name: it belongs to the cluster or the host "
                           "(names.denied_names), so it is never published", node=name)
        if name.endswith(self.denied_suffixes):
            return Refusal(Reason.RESERVED_SUFFIX, "reserved name: names under the cluster domain or a local "
                           "suffix (names.denied_suffixes, names.cluster_domain) are never published", node=name)
        if reads_as_address(name):
            return Refusal(Reason.READS_AS_ADDRESS, "the name reads as an IP address to many resolvers (all-digit "
                           "last label, or a hex/octal address form)", node=name)
        return None

    def allows(self, name: str) -> bool:
        return self.refusal(name) is None

    def publishable(self, valid: Iterable[str]) -> list[str]:
        """The names :meth:`allows`, of names already valid node names: a few C calls per name, for the hosts
        publisher's 100,000 names (an address check only for the few names that could read as one)."""
        denied, suffixes, may_be = self.denied_names, self.denied_suffixes, _MAY_READ_AS_ADDRESS.match
        return [n for n in valid
                if n not in denied and not n.endswith(suffixes) and not (may_be(n) and reads_as_address(n))]
