"""Configuration for `raven gateway` and `raven agent`: YAML file, then environment, then flags.

Precedence, lowest first: built-in defaults, the YAML file (``--config``), environment
variables (``RAVEN_<FIELD>``, nested with ``__``: ``RAVEN_TLS__CERT=/etc/raven/tls.crt``),
then ``--set field.path=value`` and the dedicated flags. An invalid file fails at start
with one line per problem naming the field, e.g. ``tunnel.listen: expected HOST:PORT``.

Why this module is long and not split: it is the configuration model of both services and its loader, one
field per setting with its description; the two services share most sections, and deploy/examples/ is checked
against this one model, so a split would only move the shared sections away from their users.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raven import version
from raven.config.pools import DirectHosts, PoolDefaults, PoolSettings, pools_nodes_unique
from raven.dns.names import DEFAULT_CLUSTER_DOMAIN, DEFAULT_DENIED_NAMES, DEFAULT_DENIED_SUFFIXES, NameRule
from raven.errors import ConfigError
from raven.layer3.config import AgentLayer3, GatewayLayer3
from raven.protocol import wire


def _host_port(value: str) -> str:
    _, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return value


def _node_name(value: str) -> str:
    if not wire.valid_node_name(value):
        raise ValueError(f"{value!r} is not a valid node name (RFC 1123: lower-case letters, digits, '-', '.')")
    return value


def _pool_name(value: str) -> str:
    if not wire.valid_node_name(value) or "." in value:
        raise ValueError(f"{value!r} is not a valid pool name (an RFC 1123 label)")
    return value


HostPort = Annotated[str, AfterValidator(_host_port)]
NodeName = Annotated[str, AfterValidator(_node_name)]
PoolName = Annotated[str, AfterValidator(_pool_name)]
Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)]


def _method(value: str) -> str:
    if not re.fullmatch(r"[A-Z]{1,20}", value):
        raise ValueError(f"{value!r} is not an HTTP method (upper-case letters, e.g. GET)")
    return value


def split_host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TLSConfig(_Model):
    cert: Path = Field(description="PEM certificate of this side")
    key: Path = Field(description="PEM private key of this side")
    ca: Path = Field(description="PEM CA bundle that the peer's certificate must chain to")
    reload_interval: Seconds = Field(60.0, description="how often to re-read rotated certificate files")

    @model_validator(mode="after")
    def _files_exist(self) -> TLSConfig:
        for name in ("cert", "key", "ca"):
            path: Path = getattr(self, name)
            if path.is_dir():
                raise ValueError(f"{name}: {str(path)!r} is a directory, not a file")
            if not path.is_file():
                raise ValueError(f"{name}: file {str(path)!r} does not exist")
        return self


class TunnelLimits(_Model):
    window: int = Field(256 * 1024, ge=16 * 1024, le=16 * 1024 * 1024, description="per-stream receive window")
    max_streams_per_session: int = Field(1024, ge=1, le=1 << 20)
    max_frame: int = Field(
        1 << 20, ge=256 * 1024, le=16 << 20,
        description="largest tunnel message; must hold a full DATA frame (64 KiB) and an OPEN with 64 KiB of headers",
    )
    heartbeat_interval: float = Field(
        3.0, gt=0, le=3600, allow_inf_nan=False, description="PING after this long without traffic"
    )
    heartbeat_timeout: float = Field(
        10.0, gt=0, le=3600, allow_inf_nan=False, description="a session silent this long is dead"
    )
    handshake_timeout: Seconds = 10.0

    @model_validator(mode="after")
    def _timeout_covers_interval(self) -> TunnelLimits:
        if self.heartbeat_timeout < 2 * self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout:g}s) must be at least twice heartbeat_interval "
                f"({self.heartbeat_interval:g}s), or a healthy session would be taken for dead"
            )
        return self


class GatewayTunnel(_Model):
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


class FrontAuth(_Model):
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
    def _consistent(self) -> FrontAuth:
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


class GatewayFront(_Model):
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
    allowed_methods: list[Annotated[str, AfterValidator(_method)]] = Field(
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

    auth: FrontAuth = Field(FrontAuth(), description="who may use the front end and the inventory endpoints")
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


class KubeSettings(_Model):
    enabled: bool = Field(False, description="learn edge nodes from the Kubernetes API (watch Nodes)")
    kubeconfig: Path | None = Field(None, description="kubeconfig file; default: in-cluster service account")
    pool_label: str = Field("apps.openyurt.io/nodepool", description="Node label naming the node's edge pool")
    node_selector: str = Field("", description="extra label selector for edge Nodes (e.g. 'node-role/edge=true')")
    reach_label: str = Field(
        "raven.io/reach", description="Node label saying how its pool is reached (tunnel, direct, layer3); "
        "without it, OpenYurt's openyurt.io/is-edge-worker=false means direct (gateway/pools.py)",
    )


class ConfigMapTarget(_Model):
    namespace: str = "kube-system"
    name: str = "edge-tunnel-nodes"
    key: str = "tunnel-nodes"


class LeaseSettings(_Model):
    namespace: str = "kube-system"
    name: str = "raven-hosts-publisher"
    duration: Seconds = 15.0


class HostsSettings(_Model):
    service_addresses: list[IPAddress] = Field(
        default_factory=list, description="addresses every edge node name resolves to (the Raven front Service)"
    )
    file: Path | None = Field(None, description="write the hosts file here (atomically, only on change)")
    configmap: ConfigMapTarget | None = Field(None, description="publish the hosts file as this ConfigMap key")
    lease: LeaseSettings = LeaseSettings()
    debounce: Seconds = Field(1.0, description="wait this long after a change before publishing")
    shards: int = Field(
        1, ge=1, le=10,
        description="split the hosts file in this many files or ConfigMaps, past one ConfigMap's 1 MiB (about "
        "35,000 names with one IPv4 service address, 16,000 with IPv4 and IPv6): shard k >= 1 goes to <file>.<k> "
        "and ConfigMap <name>-<k>, each read by a CoreDNS server block of its own (deploy/coredns/)",
    )
    direct: DirectHosts = Field(
        "omit", description="names of direct and layer3 pools: 'omit' leaves them to the cluster's own resolution "
        "(/sd then gives Prometheus their addresses); 'internal-ip' maps each to its node's address here",
    )


class NameRules(_Model):
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


class GatewayConfig(_Model):
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
    layer3: GatewayLayer3 = Field(GatewayLayer3(), description="IP between the cloud and the pools (docs/layer3.md)")
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


_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")  # "_" too: /etc/hosts and many DNS allow it


def _node_address(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    if len(value) <= 253 and all(_LABEL.fullmatch(label) for label in value.rstrip(".").split(".")):
        return value
    raise ValueError(f"{value!r} is neither an IP address nor a host name")


class AgentNode(_Model):
    name: NodeName
    address: Annotated[str, AfterValidator(_node_address)] = Field(
        description="IP address or resolvable name of the node inside the edge network"
    )


class AgentGateway(_Model):
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


class AgentConfig(_Model):
    name: str | None = Field(None, description="agent identity; defaults to the certificate's agent name")
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
    allowed_methods: list[Annotated[str, AfterValidator(_method)]] = Field(
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
    layer3: AgentLayer3 = Field(AgentLayer3(), description="IP for this pool over the tunnel (docs/layer3.md)")
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


# ---------------------------------------------------------------- loading


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"empty field path in {dotted!r}")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _scalar(text: str) -> Any:
    """Parse an override value as YAML, so that ``9400`` is a number and ``[1, 2]`` a list."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")  # model-level messages name their field
    return "\n".join(lines)


def load_tree(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return tree


def build(
    model: type[GatewayConfig] | type[AgentConfig],
    path: Path | None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    base_dir: Path | None = None,
) -> Any:
    """Load a config: file, then ``RAVEN_*`` environment, then ``field.path=value`` overrides."""
    tree = load_tree(path)
    # Relative file paths in a file (TLS, front-end TLS and token files) are relative to the file's folder;
    # in flags, to the cwd.
    root = base_dir or (path.parent if path is not None else None)
    if root is not None:
        front = tree.get("front")
        front = front if isinstance(front, dict) else {}
        for section in (tree.get("tls"), front.get("tls")):
            if isinstance(section, dict):
                for name in ("cert", "key", "ca"):
                    value = section.get(name)
                    if isinstance(value, str) and not os.path.isabs(value):
                        section[name] = str(root / value)
        auth = front.get("auth")
        if isinstance(auth, dict) and isinstance(auth.get("token_files"), list):
            auth["token_files"] = [str(root / f) if isinstance(f, str) and not os.path.isabs(f) else f
                                   for f in auth["token_files"]]
    env = os.environ if environ is None else environ
    from_env: list[str] = []
    for key, value in sorted(env.items()):
        if key.startswith("RAVEN_"):
            dotted = key.removeprefix("RAVEN_").lower().replace("__", ".")
            # Only variables that name a setting: RAVEN_NO_UVLOOP and the like are not configuration.
            if dotted.split(".")[0] in model.model_fields:
                _set_path(tree, dotted, _scalar(value))
                from_env.append(key)
    for item in overrides:
        field, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like field.path=value")
        _set_path(tree, field.strip(), _scalar(value))
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        sources = [str(path)] if path else []
        if from_env:
            sources.append("environment " + ", ".join(sorted(from_env)))
        if overrides:
            sources.append("flags")
        raise ConfigError(_format_errors(err, "; ".join(sources) or "defaults")) from None
