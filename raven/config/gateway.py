"""`raven gateway`'s configuration: the tunnel port, the front end and its credentials, the hosts file and
its publishing, the name rule, pools and layer 3.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from raven import version
from raven.config.backfill import GatewayBackfill
from raven.config.base import HostPort, KubeSettings, Method, Port, Seconds, TLSConfig, TunnelLimits
from raven.config.pools import DirectHosts, PoolDefaults, PoolSettings, pools_nodes_unique
from raven.dns.names import DEFAULT_CLUSTER_DOMAIN, DEFAULT_DENIED_NAMES, DEFAULT_DENIED_SUFFIXES, NameRule
from raven.dns.shards import MAX_SHARDS, TYPICAL_NAME_LENGTH, typical_capacity
from raven.layer3.config import GatewayLayer3Settings
from raven.model import Model
from raven.names import PoolName


class GatewayTunnel(Model):
    listen: HostPort = "0.0.0.0:10262"
    path: str = "/tunnel"
    max_connections: int = Field(
        16384, ge=1, le=1 << 20,
        description="connections the tunnel port holds at once (TLS handshakes and sessions); more are refused",
    )
    max_connections_per_address: int = Field(
        1024, ge=1, le=1 << 20,
        description="connections from one source address (many agents may share a NAT address: keep it generous)",
    )
    min_agent_version: str | None = Field(
        None, description="refuse agents of an older release (e.g. '0.2.0'; an agent that announces none is "
        "0.1.0), with the reason in both logs: the skew policy's lower bound, enforced (docs/skew.md)",
    )

    @field_validator("min_agent_version")
    @classmethod
    def _is_version(cls, value: str | None) -> str | None:
        if value is not None and (not value or version.parse(value) is None):
            raise ValueError(f"{value!r} is not a release version (e.g. 0.2.0)")
        return value


class FrontAuthSettings(Model):
    mode: Literal["bearer", "none"] | None = Field(
        None, description="'bearer': clients need a token from token_files (the default when token_files are "
        "given); 'none': the front end is open (allowed on a non-loopback address only when written explicitly)",
    )
    token_files: list[Path] = Field(
        default_factory=list,
        description="files with accepted bearer tokens, one per line (several: rotation); re-read when changed",
    )
    reload_interval: Seconds = Field(2.0, description="how often to look for changed token files")

    @model_validator(mode="after")
    def _consistent(self) -> FrontAuthSettings:
        if self.mode == "none" and self.token_files:
            raise ValueError("mode 'none' with token_files: remove one of them")
        if self.mode == "bearer" and not self.token_files:
            raise ValueError("mode 'bearer' needs token_files")
        return self


def _loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class GatewayFront(Model):
    listen: HostPort = Field("0.0.0.0:10263", description="where Prometheus's requests arrive (all ports)")
    also_listen: list[HostPort] = Field(
        default_factory=list,
        description="more listeners for the same front end, where no Service maps the target ports to one "
        "(e.g. [10.0.0.5:9400, 10.0.0.5:9100] on a host without kube-proxy)",
    )
    allowed_ports: list[Port] = Field(default_factory=lambda: [9100, 9400])
    request_timeout: Seconds = Field(30.0, description="deadline for a whole request unless Prometheus asks less")
    connect_idle_timeout: Seconds = Field(60.0, description="CONNECT tunnels idle longer than this are closed")
    max_streams_per_node: int = Field(64, ge=1, description="requests in flight to one node, from all clients")
    max_header_bytes: int = Field(16 * 1024, ge=1024, le=1 << 20)
    server: Literal["lean", "aiohttp"] = Field(
        "lean", description="the front port's HTTP server: lean (llhttp, raven/http/h1server.py) or aiohttp's")
    allowed_methods: list[Method] = Field(
        default_factory=lambda: ["GET", "HEAD"],
        description="HTTP methods passed to nodes (Prometheus only sends GET); others get 405 with an Allow header",
    )
    allow_connect: bool = Field(
        False, description="relay CONNECT (raw TCP, e.g. to a kubelet's TLS port) to allowed ports",
    )
    head_timeout: Seconds = Field(
        10.0, description="a client must send a complete request head within this long (of connecting, or of the "
        "first byte of a keep-alive request); else 408 and close",
    )
    idle_timeout: Seconds = Field(
        120.0, description="keep-alive: close a connection idle this long between requests (longer than "
        "Prometheus's 90 s idle pool, so that Prometheus closes first)",
    )
    body_timeout: Seconds = Field(10.0, description="a client must send its whole request body within this long")
    write_stall_timeout: Seconds = Field(
        10.0, description="a client that reads none of its response for this long has its stream reset (the "
        "agent releases the node connection) and its connection closed",
    )
    max_connections: int = Field(
        32768, ge=1, le=1 << 20,
        description="front-end connections held at once (a Prometheus HA pair in DNS mode holds one per target "
        "each: 20,000 for 10,000 nodes and one exporter); a connection beyond it has its first request answered "
        "503, naming the node, and is closed",
    )
    max_connections_per_client: int = Field(
        2048, ge=1, le=1 << 20,
        description="authenticated connections from one client address, at least: the gateway allows 1.25 x "
        "registered nodes x allowed_ports when that is more (a Prometheus holds one keep-alive connection per "
        "target)",
    )
    max_unauthenticated: int = Field(
        4096, ge=1, le=1 << 20,
        description="connections that have not yet sent a request with valid credentials (or sent only "
        "refused ones), from all clients; more are refused at once",
    )
    max_unauthenticated_per_client: int = Field(
        256, ge=1, le=1 << 20,
        description="such connections from one client address (a real client's connection is unauthenticated "
        "only until its first request head arrives)",
    )
    client_share: float = Field(
        0.25, gt=0, le=1, allow_inf_nan=False,
        description="share of a node's max_streams_per_node one client address may hold at once",
    )
    max_connect_tunnels: int = Field(256, ge=1, description="CONNECT tunnels open at once, from all clients")
    max_connect_per_client: int = Field(32, ge=1, description="CONNECT tunnels open at once from one client address")
    fd_reserve: int = Field(
        2048, ge=64, le=1 << 20,
        description="open-file descriptors kept back from the front end for the tunnel, ops port and files, so "
        "that they keep working while the front end is saturated",
    )

    auth: FrontAuthSettings = Field(
        FrontAuthSettings(), description="who may use the front end and the inventory endpoints",
    )
    tls: TLSConfig | None = Field(
        None, description="serve the front end over TLS and require a client certificate signed by tls.ca",
    )

    @model_validator(mode="after")
    def _no_connect_method(self) -> GatewayFront:
        if "CONNECT" in self.allowed_methods:
            raise ValueError("allowed_methods: CONNECT is not a request method here; set allow_connect: true")
        return self

    def open_exposure(self) -> list[str]:
        """The non-loopback addresses this front end listens on without any credentials (empty if none)."""
        if self.auth.token_files or self.tls is not None or self.auth.mode == "none":
            return []
        return [a for a in (self.listen, *self.also_listen) if not _loopback(a)]


def _ip(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 or IPv6 address") from None
    return value


IPAddress = Annotated[str, AfterValidator(_ip)]


class ConfigMapTarget(Model):
    namespace: str = "kube-system"
    name: str = "edge-tunnel-nodes"
    key: str = "tunnel-nodes"


class LeaseSettings(Model):
    namespace: str = "kube-system"
    name: str = "raven-hosts-publisher"
    duration: Seconds = 15.0


_CAPACITY = typical_capacity()  # names one ConfigMap holds (IPv4; IPv4 and IPv6), as the docs say it


class HostsSettings(Model):
    service_addresses: list[IPAddress] = Field(
        default_factory=list, description="addresses every edge node name resolves to (the Raven front Service)"
    )
    file: Path | None = Field(None, description="write the hosts file here (atomically, only on change)")
    configmap: ConfigMapTarget | None = Field(None, description="publish the hosts file as this ConfigMap key")
    lease: LeaseSettings = LeaseSettings()
    debounce: Seconds = Field(1.0, description="wait this long after a change before publishing")
    shards: int = Field(
        1, ge=1, le=MAX_SHARDS,
        description="split the hosts file in this many files or ConfigMaps, past one ConfigMap's 1 MiB (about "
        f"{_CAPACITY[0]:,} names of {TYPICAL_NAME_LENGTH} characters with one IPv4 service address, {_CAPACITY[1]:,} "
        "with IPv4 and IPv6): shard k >= 1 goes to <file>.<k> and ConfigMap <name>-<k>, each read by a CoreDNS server "
        "block of its own (deploy/coredns/)",
    )
    direct: DirectHosts = Field(
        "omit", description="names of direct and layer3 pools: 'omit' leaves them to the cluster's own resolution "
        "(/sd then gives Prometheus their addresses); 'internal-ip' maps each to its node's address here",
    )


class NameRules(Model):
    """Which node names may be published in the hosts file CoreDNS serves (raven/dns/names.py)."""

    denied_names: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DENIED_NAMES),
        description="names never published, whoever claims them (replaces the default list: keep its entries "
        "when you add to it; or use extra_denied_names)",
    )
    extra_denied_names: list[str] = Field(
        default_factory=list, description="more names never published (e.g. your own Services' short names)",
    )
    denied_suffixes: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DENIED_SUFFIXES), description="names ending in these are never published",
    )
    cluster_domain: str = Field(
        DEFAULT_CLUSTER_DOMAIN, max_length=253,
        description="the cluster's DNS domain: names under it are never published",
    )

    def rule(self) -> NameRule:
        return NameRule([*self.denied_names, *self.extra_denied_names], self.denied_suffixes, self.cluster_domain)


class GatewayConfig(Model):
    backfill: GatewayBackfill = GatewayBackfill()
    replica_id: str = Field(default_factory=socket.gethostname)
    replicas: int = Field(1, ge=1, le=1 << 16, description="how many gateway replicas serve this Service")
    tunnel: GatewayTunnel = GatewayTunnel()
    front: GatewayFront = GatewayFront()
    metrics_listen: HostPort = "0.0.0.0:10265"
    tls: TLSConfig
    limits: TunnelLimits = TunnelLimits()
    kubernetes: KubeSettings = KubeSettings()
    hosts: HostsSettings = HostsSettings()
    ready_settle: float = Field(
        2.0, ge=0, le=300,
        description="with Kubernetes, after start /readyz waits until every pool with edge Nodes has an agent "
        "session and then for this long without a new one",
    )
    ready_max_wait: Seconds = Field(
        45.0,
        description="the agents' reconnect bound: their gateway.backoff_max (30 s) plus dial_timeout (10 s) and a "
        "margin. After a start, a node not heard of yet is answered 503 (retry), not 404, until the agents are "
        "back or this long has passed, and /readyz waits as long (without Kubernetes, always this long); later, "
        "a replica that has lost every agent session for this long turns unready",
    )
    node_rebind_after: Seconds = Field(
        3600.0, description="a node stays bound to its pool this long after its last agent left; until then "
        "another pool's claim is refused",
    )
    max_nodes_per_agent: int = Field(
        10000, ge=1, description="nodes one agent identity may register, across all its sessions",
    )
    max_nodes_total: int = Field(50000, ge=1, description="nodes this gateway holds, from all agents")
    max_sessions_per_agent: int = Field(
        8, ge=1, le=1 << 16,
        description="sessions one agent identity may hold to this replica at once (it needs one, plus a "
        "reconnect's overlap)",
    )
    max_sessions_total: int = Field(10000, ge=1, le=1 << 20, description="agent sessions this replica holds")
    session_rate: float = Field(
        0.5, gt=0, le=1000, allow_inf_nan=False,
        description="new sessions per second one agent identity may open, after a burst of session_burst",
    )
    session_burst: int = Field(30, ge=1, le=1 << 16)
    register_rate: float = Field(
        1.0, gt=0, le=1000, allow_inf_nan=False,
        description="registrations per second one agent identity may send, after a burst of register_burst; "
        "more are held (the newest replaces a held one) and applied when the rate allows",
    )
    register_burst: int = Field(10, ge=1, le=1 << 16)
    names: NameRules = Field(NameRules(), description="the rule for node names that reach DNS")
    allowed_name_suffixes: list[str] = Field(
        default_factory=list,
        description="without Kubernetes, dotted node names an agent may claim must end in one of these "
        "(e.g. '.edge.example.com'); single-label names are always allowed",
    )
    drain_linger: float = Field(
        3.0, ge=0, le=300,
        description="after SIGTERM, keep serving new requests this long while /readyz says 503 "
        "(so that load balancers stop sending), then wait for requests in flight",
    )
    drain_grace: Seconds = 20.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    config_watch_interval: Seconds = Field(
        5.0, description="how often to look for a changed configuration file (reloaded like on SIGHUP)",
    )
    layer3: GatewayLayer3Settings = Field(
        GatewayLayer3Settings(), description="IP between the cloud and the pools (docs/layer3.md)",
    )
    pools: dict[PoolName, PoolSettings] = Field(
        default_factory=dict, description="per pool: how it is reached (reach: tunnel | direct | layer3), whether "
        "its agents compress, and the nodes of a direct pool outside Kubernetes (raven/config/pools.py)",
    )
    pool_defaults: PoolDefaults = Field(PoolDefaults(), description="for pools not listed under pools")

    @model_validator(mode="after")
    def _pool_nodes_unique(self) -> GatewayConfig:
        problem = pools_nodes_unique(dict(self.pools))
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _front_authenticated_unless_loopback(self) -> GatewayConfig:
        exposed = self.front.open_exposure()
        if exposed:
            raise ValueError(
                f"front.auth: the front end listens on {', '.join(exposed)} without credentials, so anything that "
                "reaches it can scrape every edge node: set front.auth.token_files (bearer tokens, what "
                "Prometheus sends with credentials_file) or front.tls (client certificates), or write "
                "front.auth.mode: none to run it open"
            )
        return self


# Settings a running gateway cannot take over: listeners, identity, the tunnel's wire limits, Kubernetes and
# where the hosts file goes. A reload that changes them says so and keeps the old values until a restart.
RESTART_ONLY = (
    "replica_id", "replicas", "tunnel.listen", "tunnel.path", "front.listen", "front.also_listen", "front.tls",
    "front.fd_reserve", "front.max_header_bytes", "front.server", "metrics_listen", "tls", "limits", "kubernetes",
    "hosts.file", "hosts.configmap", "hosts.lease", "hosts.shards", "config_watch_interval", "backfill",
)
