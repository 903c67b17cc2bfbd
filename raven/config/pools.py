"""How each node pool is reached, in the gateway's configuration (``pools:``, ``pool_defaults:``).

Three ways, named by ``reach``:

* ``tunnel``: a basic edge pool behind NAT; Prometheus scrapes its nodes by name through the Raven tunnel
  (the default);
* ``direct``: an on-cloud pool, or a dedicated line that is routable: Prometheus scrapes the nodes itself and
  Raven stays out of the way (no agent needed, no name in the hosts file, the gateway refuses to proxy);
* ``layer3``: a dedicated edge pool reached over Raven's layer 3 (docs/layer3.md): Prometheus scrapes the
  node's address directly, and the route to it goes through the layer-3 tunnel; the gateway's layer-7 proxy
  refuses it like a direct pool.

A pool's reach comes from, in this order: its entry in ``pools:``, its Nodes' labels in Kubernetes
(gateway/pools.py), ``pool_defaults.reach``. The gateway's configuration (raven/config/gateway.py) uses it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raven.layer3.config import IPAddress
from raven.model import Model
from raven.names import NodeName

Reach = Literal["tunnel", "direct", "layer3"]
REACHES: tuple[Reach, ...] = ("tunnel", "direct", "layer3")
DirectHosts = Literal["omit", "internal-ip"]


class PoolNode(Model):
    """A node of a pool the gateway cannot learn from an agent (direct or layer-3 pools outside Kubernetes)."""

    name: NodeName
    address: IPAddress | None = Field(
        None, description="the node's address Prometheus can reach (its InternalIP); without it, the node's name",
    )


class PoolSettings(Model):
    reach: Reach | None = Field(
        None, description="tunnel | direct | layer3; unset: from the pool's Nodes' labels in Kubernetes, else "
        "pool_defaults.reach",
    )
    compress: bool | None = Field(
        None, description="let the agents gzip responses for clients that accept it (uplink bytes); unset: "
        "pool_defaults.compress. Only tunnel pools carry responses",
    )
    nodes: list[PoolNode] = Field(
        default_factory=list, max_length=50000,
        description="nodes of a direct or layer3 pool, for /sd and the hosts file where no Kubernetes Node "
        "objects list them",
    )

    @model_validator(mode="after")
    def _consistent(self) -> PoolSettings:
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"nodes: {', '.join(dup)} listed twice")
        if self.nodes and self.reach == "tunnel":
            raise ValueError("nodes: a tunnel pool's nodes come from its agents (or Kubernetes), not from here")
        return self


class PoolDefaults(Model):
    reach: Reach = Field("tunnel", description="the reach of a pool that is neither listed nor labelled")
    compress: bool = Field(
        True, description="whether tunnel pools' agents may gzip responses (off where the uplink is free)",
    )


def pools_nodes_unique(pools: dict[str, PoolSettings]) -> str | None:
    """A node listed under two pools: the message, or None."""
    seen: dict[str, str] = {}
    for pool, settings in sorted(pools.items()):
        for node in settings.nodes:
            if node.name in seen:
                return f"pools: node {node.name!r} is listed under both {seen[node.name]!r} and {pool!r}"
            seen[node.name] = pool
    return None
