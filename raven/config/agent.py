"""`raven agent`'s configuration: its gateways, its nodes, what it lets a gateway open, and layer 3.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, model_validator

from raven.config.base import (
    HostPort,
    KubeSettings,
    Method,
    Port,
    Seconds,
    TLSConfig,
    TunnelLimits,
)
from raven.layer3.config import AgentLayer3Settings
from raven.model import Model
from raven.names import NodeName, PoolName

_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")  # "_" too: /etc/hosts and many DNS allow it


def _node_address(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    if len(value) <= 253 and all(_LABEL.fullmatch(label) for label in value.rstrip(".").split(".")):
        return value
    raise ValueError(f"{value!r} is neither an IP address nor a host name")


class AgentNode(Model):
    name: NodeName
    address: Annotated[str, AfterValidator(_node_address)] = Field(
        description="IP address or resolvable name of the node inside the edge network"
    )


class AgentGateway(Model):
    url: str = Field("wss://raven-gateway:10262/tunnel", description="wss:// URL of the gateway tunnel")
    server_name: str | None = Field(None, description="name to verify in the gateway certificate")
    dial_timeout: Seconds = 10.0
    connect_timeout: Seconds = Field(
        3.0, description="TCP connect to the gateway (within dial_timeout); a dial that cannot even connect this "
        "long never reached the gateway (the uplink is down) and is retried within unreachable_retry",
    )
    backoff_initial: Seconds = 0.5
    backoff_max: Seconds = Field(
        30.0, description="reconnect backoff cap (exponential, full jitter) after a dial the gateway refused or "
        "failed: it spreads a fleet's reconnects over this long when a gateway comes back",
    )
    unreachable_retry: Seconds = Field(
        2.0, description="after a dial that never reached the gateway (no route, TCP connect timed out), the next "
        "one comes within this (jittered), however long the outage: a returning uplink is found within seconds, "
        "and dials that reach nobody cost the gateway nothing (docs/uplinks.md)",
    )
    max_replicas: int = Field(
        16, ge=1, le=1024,
        description="the most links (sessions to gateway replicas) this agent holds, whatever a gateway's WELCOME "
        "claims and however many addresses its name resolves to: a gateway that claims more is told about once "
        "(log line, raven_agent_gateway_replicas_reported) and the agent holds this many",
    )
    dial_rate: float = Field(
        2.0, gt=0, le=1000, allow_inf_nan=False,
        description="dials to the gateway a second, all links together, once dial_burst is spent (a lying or "
        "broken gateway cannot make the agent dial in a loop)",
    )
    dial_burst: int = Field(
        8, ge=1, le=1024,
        description="dials at once before dial_rate applies: a start or a reconnect to a few replicas is not slowed",
    )
    resolver: HostPort | None = Field(
        None, description="DNS server (IP:PORT) for the gateway's name; default: the system's resolv.conf"
    )

    @model_validator(mode="after")
    def _resolver_is_an_ip(self) -> AgentGateway:
        if self.resolver is not None:
            host = self.resolver.rpartition(":")[0].strip("[]")
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"resolver: must be IP:PORT (a DNS server's address), got {self.resolver!r}") from None
        return self
    resolve_interval: Seconds = Field(30.0, description="how often to re-resolve the gateway's name")

    @model_validator(mode="after")
    def _wss(self) -> AgentGateway:
        if not self.url.startswith("wss://"):
            raise ValueError(f"url: must start with wss:// (TLS is required), got {self.url!r}")
        parts = urlsplit(self.url)
        try:
            parts.port  # noqa: B018 (raises for a port out of range)
        except ValueError:
            raise ValueError(f"url: bad port in {self.url!r}") from None
        if not parts.hostname:
            raise ValueError(f"url: no host in {self.url!r}")
        return self


class AgentBackfill(Model):
    """Keep scraping through an outage and send the pages back when a session returns (docs/backfill.md)."""

    enabled: bool = Field(True, description="scrape the pool's learned targets while no gateway session is up")
    directory: str | None = Field(None, description="a volume to keep the backlog on (survives a restart); "
                                  "none: in memory only")
    max_bytes: int = Field(256 * 1024 * 1024, ge=1 << 20, le=1 << 40,
                           description="the backlog's byte cap: past it the oldest 5 minutes go first")
    max_age: Seconds = Field(6 * 3600.0, description="kept scrapes older than this are dropped")
    rate: float = Field(2 * 1024 * 1024, gt=0, le=1 << 34, allow_inf_nan=False,
                        description="bytes a second the backlog may take of the uplink once a session is back")
    batch_bytes: int = Field(1024 * 1024, ge=64 * 1024, le=64 * 1024 * 1024,
                             description="compressed bytes of scrapes per backfill stream")
    max_page: int = Field(64 * 1024 * 1024, ge=1024, le=1 << 30, description="largest page kept from one scrape")


class AgentConfig(Model):
    name: NodeName | None = Field(None, description="agent identity (an RFC 1123 name, as the gateway requires); "
                                  "defaults to the certificate's agent name")
    pool: PoolName | None = Field(
        None, description="the edge pool this agent serves; defaults to the certificate's pool when it names one"
    )
    gateway: AgentGateway = AgentGateway()
    nodes: list[AgentNode] = Field(default_factory=list)
    allowed_ports: list[Port] = Field(default_factory=lambda: [9100, 9400])
    connect_timeout: Seconds = Field(3.0, description="deadline to open a connection to a node port")
    request_timeout: Seconds = Field(30.0, description="default deadline when the gateway sends none")
    upstream_connections_per_node: int = Field(
        16, ge=1, le=1024, description="requests (HTTP or TCP) to one node at once; more wait in a fair queue",
    )
    upstream_client_share: float = Field(
        0.5, gt=0, le=1, allow_inf_nan=False,
        description="share of a node's upstream connections one gateway client may hold (its fairness key)",
    )
    upstream_idle_timeout: Seconds = Field(
        90.0, description="a keep-alive connection to a node closes after this long without a request (longer than "
        "the scrape interval keeps one connection per scraped node; shorter reconnects on every scrape)",
    )
    upstream_max_connections: int = Field(
        4096, ge=1, le=1 << 20,
        description="connections to nodes at once, all nodes together (HTTP and TCP); at the cap the least recently "
        "used idle one closes, and when all are busy a request waits up to connect_timeout, then gets 503. Size it "
        "about 2 per node (a Prometheus HA pair keeps one each); the open-files limit must exceed it",
    )
    allowed_methods: list[Method] = Field(
        default_factory=lambda: ["GET", "HEAD"],
        description="HTTP methods this agent passes to nodes, whatever the gateway sends",
    )
    allow_connect: bool = Field(False, description="serve CONNECT (raw TCP) streams to allowed ports")
    compress: Literal["auto", "always", "never"] = Field(
        "auto", description="gzip a node's uncompressed response for a client that accepts gzip, before the "
        "uplink: 'auto' unless the gateway says the pool's uplink is free (its pools.<pool>.compress), 'always', "
        "'never' (agent/compress.py)",
    )
    metrics_listen: HostPort = "0.0.0.0:10266"
    tls: TLSConfig
    limits: TunnelLimits = TunnelLimits()
    kubernetes: KubeSettings = KubeSettings()
    drain_grace: Seconds = 20.0
    layer3: AgentLayer3Settings = Field(
        AgentLayer3Settings(), description="IP for this pool over the tunnel (docs/layer3.md)",
    )
    backfill: AgentBackfill = AgentBackfill()
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    config_watch_interval: Seconds = Field(
        5.0, description="how often to look for a changed configuration file (reloaded like on SIGHUP)",
    )

    @model_validator(mode="after")
    def _unique_nodes(self) -> AgentConfig:
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise ValueError(f"nodes: {node.name!r} is listed twice")
            seen.add(node.name)
        return self


# Settings a running agent cannot take over: its identity, where it dials, its listeners and wire limits.
RESTART_ONLY = ("name", "pool", "gateway", "metrics_listen", "tls", "limits", "kubernetes",
                "config_watch_interval", "backfill")
