"""Configuration for `raven gateway` and `raven agent`: YAML file, then environment, then flags.

Precedence, lowest first: built-in defaults, the YAML file (``--config``), environment
variables (``RAVEN_<FIELD>``, nested with ``__``: ``RAVEN_TLS__CERT=/etc/raven/tls.crt``),
then ``--set field.path=value`` and the dedicated flags. An invalid file fails at start
with one line per problem naming the field, e.g. ``tunnel.listen: expected HOST:PORT``.

The model (on the base raven/model.py; node and pool names are raven/names.py) lives in named modules:
``base`` (field types, TLS, tunnel limits, Kubernetes: shared by both),
``gateway``, ``agent``, and ``loading`` (file, environment, flags). Every name is re-exported here.
"""

from __future__ import annotations

from raven.config.agent import AgentConfig, AgentGateway, AgentNode
from raven.config.base import (
    HostPort,
    KubeSettings,
    Method,
    Port,
    Seconds,
    TLSConfig,
    TunnelLimits,
)
from raven.config.gateway import (
    ConfigMapTarget,
    FrontAuthSettings,
    GatewayConfig,
    GatewayFront,
    GatewayTunnel,
    HostsSettings,
    IPAddress,
    LeaseSettings,
    NameRules,
)
from raven.config.loading import build, load_tree

__all__ = [
    "AgentConfig",
    "AgentGateway",
    "AgentNode",
    "ConfigMapTarget",
    "FrontAuthSettings",
    "GatewayConfig",
    "GatewayFront",
    "GatewayTunnel",
    "HostPort",
    "HostsSettings",
    "IPAddress",
    "KubeSettings",
    "LeaseSettings",
    "Method",
    "NameRules",
    "Port",
    "Seconds",
    "TLSConfig",
    "TunnelLimits",
    "build",
    "load_tree",
]
