"""Which way each pool is reached (tunnel, direct, layer3), and the nodes Prometheus scrapes without the proxy.

A pool's reach, first match wins:

1. its entry in the gateway's configuration (``pools.<name>.reach``): the operator's word;
2. in Kubernetes, its Nodes' labels: ``raven.io/reach`` (``kubernetes.reach_label``) when set, else OpenYurt's
   ``openyurt.io/is-edge-worker``: ``"false"`` means a cloud node, so direct. OpenYurt sets that label on every
   node it manages (a NodePool of type Cloud holds nodes with ``false``), and the Node watch already carries the
   labels: no NodePool read, no extra RBAC rule, no second watch. Nodes of one pool that disagree make the
   pool ``tunnel`` (the way that works for any node with an agent) and a warning;
3. ``pool_defaults.reach`` (``tunnel``).

The nodes of a pool that is not reached through the tunnel come from Kubernetes Node objects (address: the
node's InternalIP), from ``pools.<name>.nodes`` in the configuration, and from any agent that registered them
(its registration's address when it is an IP). They are listed in ``/sd`` with ``reach`` set, and, with
``hosts.direct: internal-ip``, in the hosts file at their own address; the front end refuses to proxy to them.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from raven.config import GatewayConfig
from raven.config.pools import REACHES, Reach
from raven.hostport import url_host
from raven.refusals import Reason, Refusal

if TYPE_CHECKING:
    from gateway.registry import NodeEntry
    from raven.kube import KubeNode

log = logging.getLogger("raven.gateway.pools")

OPENYURT_EDGE_LABEL = "openyurt.io/is-edge-worker"


class RegisteredNode(Protocol):
    """A node as an agent registered it (a registry entry, or the views' copy of one)."""

    @property
    def name(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def address(self) -> str: ...


@dataclass(frozen=True, slots=True)
class DirectNode:
    """A node Prometheus scrapes without the proxy: its pool's reach and the address to use (None: its name)."""

    name: str
    pool: str
    reach: Reach
    address: str | None


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def label_reach(labels: Mapping[str, str], reach_label: str) -> Reach | None:
    """What one Node's labels say about its pool's reach (None: nothing)."""
    value = labels.get(reach_label, "").strip().lower()
    for reach in REACHES:
        if value == reach:
            return reach
    if labels.get(OPENYURT_EDGE_LABEL, "").strip().lower() == "false":
        return "direct"
    return None


class Pools:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.labelled: dict[str, Reach] = {}  # pool -> reach, from Node labels
        self.kube_nodes: Mapping[str, KubeNode] = {}
        self._warned: set[str] = set()
        self.version = 0  # goes up at every change of what this says (the views' caches key on it)
        self.configure(cfg)

    def configure(self, cfg: GatewayConfig) -> None:
        """Take the pools' settings (at start and on a configuration reload)."""
        self.version += 1
        self.settings = dict(cfg.pools)
        self.defaults = cfg.pool_defaults
        self.reach_label = cfg.kubernetes.reach_label
        self.hosts_direct = cfg.hosts.direct
        self.static: dict[str, tuple[str, str | None]] = {  # node -> (pool, address) from the configuration
            node.name: (pool, node.address) for pool, s in self.settings.items() for node in s.nodes
        }

    def placed(self) -> dict[str, str]:
        """Node -> pool for every node the configuration lists (``pools.<pool>.nodes``): no other pool's agent may
        claim them (gateway/registry.py)."""
        return {name: pool for name, (pool, _) in self.static.items()}

    def set_kube_nodes(self, nodes: Mapping[str, KubeNode]) -> None:
        """The Node objects changed: learn each pool's reach from its Nodes' labels."""
        self.version += 1
        self.kube_nodes = nodes
        said: dict[str, set[Reach | None]] = {}
        for node in nodes.values():
            if node.pool:
                said.setdefault(node.pool, set()).add(label_reach(node.labels, self.reach_label))
        labelled: dict[str, Reach] = {}
        for pool, words in said.items():
            if words == {None}:
                continue
            if len(words) == 1:
                labelled[pool] = next(w for w in words if w is not None)
                continue
            labelled[pool] = "tunnel"
            if pool not in self._warned:
                self._warned.add(pool)
                log.warning("the Nodes of pool %r disagree on how it is reached (%s, by labels %s and %s): treating "
                            "it as reach: tunnel; label every Node of the pool alike or set pools.%s.reach", pool,
                            ", ".join(sorted(w or "unlabelled" for w in words)), self.reach_label,
                            OPENYURT_EDGE_LABEL, pool)
        self.labelled = labelled

    def reach(self, pool: str) -> Reach:
        settings = self.settings.get(pool)
        if settings is not None and settings.reach is not None:
            return settings.reach
        return self.labelled.get(pool, self.defaults.reach)

    def source(self, pool: str) -> str:
        """Where :meth:`reach` comes from: ``config``, ``labels`` or ``default`` (the status page says it)."""
        settings = self.settings.get(pool)
        if settings is not None and settings.reach is not None:
            return "config"
        return "labels" if pool in self.labelled else "default"

    def tunnelled(self, pool: str) -> bool:
        return self.reach(pool) == "tunnel"

    def compress(self, pool: str) -> bool:
        settings = self.settings.get(pool)
        if settings is not None and settings.compress is not None:
            return settings.compress
        return self.defaults.compress

    def configured_pools(self) -> list[str]:
        return sorted(self.settings)

    def not_tunnelled(self, node: str, entry: NodeEntry | None) -> tuple[str, Reach] | None:
        """The (pool, reach) of a node that must not go through the proxy; None for a tunnel pool's (or unknown) node.

        The pool is the registry's (an agent's claim) when there is one, else its Node object's, else the
        configuration's.
        """
        pool: str | None = entry.pool if entry is not None else None
        if pool is None:
            kube = self.kube_nodes.get(node)
            pool = kube.pool if kube is not None else None
        if pool is None:
            static = self.static.get(node)
            pool = static[0] if static is not None else None
        if pool is None:
            return None
        reach = self.reach(pool)
        return None if reach == "tunnel" else (pool, reach)

    def check_proxied(self, node: str, entry: NodeEntry | None) -> None:
        """Raise the front end's refusal for a node Prometheus reaches itself: 421 Misdirected Request.

        421 rather than 403: nothing is forbidden, the request came to the wrong place (RFC 9110 section 15.5.20:
        this server is not the one to produce the answer) and may be sent again elsewhere; a 403 would read as a
        credentials problem, and a 503 (no agent) as an outage. Counted as ``direct-pool``; being a 4xx, it
        leaves the node's last scrape on the status page be.
        """
        where = self.not_tunnelled(node, entry)
        if where is None:
            return
        pool, reach = where
        way = "over layer 3" if reach == "layer3" else "directly"
        raise Refusal(Reason.DIRECT_POOL, f"node {node!r} of pool {pool!r} is reached {way} (reach: {reach}): "
                      "scrape it without the proxy", node=node, pool=pool)

    def direct_nodes(self, registered: Collection[RegisteredNode]) -> list[DirectNode]:
        """Every known node of a pool that is not reached through the tunnel, sorted by name."""
        out: dict[str, DirectNode] = {}
        for name, (pool, address) in self.static.items():
            reach = self.reach(pool)
            if reach != "tunnel":
                out[name] = DirectNode(name, pool, reach, address)
        for kube in self.kube_nodes.values():
            if kube.pool and kube.name not in out:
                reach = self.reach(kube.pool)
                if reach != "tunnel":
                    out[kube.name] = DirectNode(kube.name, kube.pool, reach, kube.internal_ip)
        reaches = {pool: self.reach(pool) for pool in {e.pool for e in registered}}  # once per pool, not per node
        if all(reach == "tunnel" for reach in reaches.values()):
            registered = ()  # the usual case: no registered node is scraped directly, none needs a look
        for entry in registered:
            reach = reaches[entry.pool]
            if reach != "tunnel" and entry.name not in out:
                out[entry.name] = DirectNode(entry.name, entry.pool, reach,
                                             entry.address if _is_ip(entry.address) else None)
        return [out[name] for name in sorted(out)]

    def hosts_entries(self, registered: Collection[RegisteredNode]) -> dict[str, str]:
        """Name -> address lines for the hosts file (``hosts.direct: internal-ip``); empty with ``omit``."""
        if self.hosts_direct != "internal-ip":
            return {}
        return {n.name: n.address for n in self.direct_nodes(registered) if n.address is not None}

    def sd_address(self, node: DirectNode) -> str:
        """What Prometheus should dial for a direct node: its name where the hosts file maps it (or nothing is
        known), else its address."""
        if self.hosts_direct == "internal-ip" or node.address is None:
            return node.name
        return url_host(node.address)
