"""Prometheus metrics of both services, each in its own registry (several can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from raven import version
from raven.ops.gcpause import GcCollector

CERT_EXPIRY_HELP = "notAfter of this service's certificate (role gateway/agent) and of each trusted CA, Unix seconds"


def cert_expiry_gauge(registry: CollectorRegistry) -> Gauge:
    return Gauge("raven_certificate_expiry_timestamp_seconds", CERT_EXPIRY_HELP, ["role", "subject"],
                 registry=registry)


def set_cert_expiry(gauge: Gauge, entries: list[tuple[str, str, float]]) -> None:
    """Replace the gauge's series with these (role, subject, notAfter): a rotated-away certificate leaves."""
    gauge.clear()
    for role, subject, not_after in entries:
        gauge.labels(role, subject).set(not_after)


def build_info(registry: CollectorRegistry) -> Gauge:
    """``raven_build_info{version,protocol} 1``: this build's release and the tunnel protocol versions it speaks
    (``1,2``), on both services, so that a fleet's mix of releases is one query (docs/skew.md)."""
    gauge = Gauge("raven_build_info", "This build: its release (version) and the tunnel protocol versions it "
                  "speaks (protocol), value 1", ["version", "protocol"], registry=registry)
    gauge.labels(version.RELEASE, version.protocols()).set(1)
    return gauge


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.build_info = build_info(r)
        self.sessions = Gauge("raven_gateway_sessions", "Agent sessions connected", ["pool"], registry=r)
        self.streams = Gauge("raven_gateway_streams_in_flight", "Streams open through the tunnel", registry=r)
        self.requests = Counter(
            "raven_gateway_requests", "Proxied requests by pool, kind and response code", ["pool", "kind", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "raven_gateway_request_duration_seconds", "Time to the last byte of a proxied response", ["pool"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.bytes = Counter(
            "raven_gateway_bytes", "Body bytes proxied, by direction (to_edge, from_edge)", ["pool", "direction"],
            registry=r,
        )
        self.retries = Counter("raven_gateway_retries", "Requests retried on another agent", ["pool"], registry=r)
        self.refusals = Counter(
            "raven_gateway_registration_refusals", "Node registrations refused", ["pool", "reason"], registry=r
        )
        self.nodes = Gauge("raven_gateway_nodes", "Edge nodes with at least one agent session", ["pool"], registry=r)
        self.handshake_failures = Counter(
            "raven_gateway_handshake_failures", "Tunnel handshakes that failed", ["reason"], registry=r
        )
        self.cert_expiry = cert_expiry_gauge(r)
        r.register(GcCollector())
        # process_open_fds and process_max_fds (and CPU, memory): raven check sets them against the fleet's need.
        ProcessCollector(registry=r)
        self.front_refused = Counter(
            "raven_gateway_front_refused",
            "Front-end requests and connections refused by a limit or a check, by reason (a fixed word)",
            ["reason"], registry=r,
        )
        self.front_connections = Gauge(
            "raven_gateway_front_connections", "Front-end connections held, by state (authenticated: has sent a "
            "request with valid credentials; unauthenticated: not yet)", ["state"], registry=r,
        )
        self.connection_refusals = Counter(
            "raven_gateway_front_connection_refusals",
            "Requests refused because their connection was beyond a connection cap, by the node's pool and reason "
            "(over-capacity: front.max_connections; client-cap: the client address's authenticated connections)",
            ["pool", "reason"], registry=r,
        )
        self.l3_packets = Counter(
            "raven_gateway_layer3_packets", "Layer-3 packets forwarded, by pool and direction (to_pool, from_pool)",
            ["pool", "direction"], registry=r,
        )
        self.l3_bytes = Counter(
            "raven_gateway_layer3_bytes", "Layer-3 bytes forwarded, by pool and direction (to_pool, from_pool)",
            ["pool", "direction"], registry=r,
        )
        self.l3_drops = Counter(
            "raven_gateway_layer3_drops", "Layer-3 packets dropped, by reason (spoofed, no-route, queue-full, "
            "too-big, edge-to-edge-denied, malformed)", ["reason"], registry=r,
        )
        self.l3_active = Gauge(
            "raven_gateway_layer3_active_agent", "1 for the agent that carries its pool's layer-3 traffic",
            ["pool", "agent"], registry=r,
        )


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.build_info = build_info(r)
        self.sessions = Gauge("raven_agent_sessions", "Sessions up to gateway replicas", registry=r)
        self.connects = Counter("raven_agent_connect_attempts", "Dial attempts by result", ["result"], registry=r)
        self.replicas_reported = Gauge(
            "raven_agent_gateway_replicas_reported", "Gateway replicas the latest WELCOME says exist (the agent "
            "holds at most gateway.max_replicas links)", registry=r,
        )
        self.links = Gauge("raven_agent_gateway_links", "Links to the gateway the agent keeps (one session each, "
                           "at most gateway.max_replicas)", registry=r)
        self.streams = Gauge("raven_agent_streams_in_flight", "Streams being forwarded", registry=r)
        # No per-node series: the agent serves one pool, so its own series are per pool already (the scrape job
        # adds `pool`), and their number does not grow with the nodes. Per node, Prometheus records `up` and
        # `scrape_duration_seconds` itself, and the gateway's status page keeps each node's last error.
        self.requests = Counter(
            "raven_agent_requests", "Forwarded requests by kind and outcome", ["kind", "code"], registry=r,
        )
        self.latency = Histogram(
            "raven_agent_upstream_duration_seconds", "Time to the last byte from the node (all of the pool's nodes)",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.upstream_open = Gauge(
            "raven_agent_upstream_connections", "Connections to nodes open now, busy or idle (upstream_max_connections "
            "bounds them)", registry=r,
        )
        self.upstream_idle = Gauge(
            "raven_agent_upstream_connections_idle", "Keep-alive connections to nodes waiting for their next request",
            registry=r,
        )
        self.upstream_limit = Gauge(
            "raven_agent_upstream_connections_limit", "The cap on connections to nodes in effect (the setting, or "
            "less when the open-files limit is lower)", registry=r,
        )
        self.upstream_waits = Counter(
            "raven_agent_upstream_cap_waits", "Requests that waited for a connection because the cap was reached "
            "and no idle connection could be closed", registry=r,
        )
        self.bytes = Counter(
            "raven_agent_bytes", "Body bytes forwarded, by direction (to_node; from_node: as the node sent "
            "them; to_gateway: on the uplink, after gzip)", ["direction"], registry=r
        )
        self.refused = Counter("raven_agent_refused_streams", "Streams refused by the agent", ["reason"], registry=r)
        self.nodes_refused = Gauge("raven_agent_nodes_refused",
                                   "Nodes of this agent's inventory a gateway refused (its latest answers)", registry=r)
        self.l3_packets = Counter(
            "raven_agent_layer3_packets", "Layer-3 packets, by direction (to_gateway, from_gateway)", ["direction"],
            registry=r,
        )
        self.l3_bytes = Counter(
            "raven_agent_layer3_bytes", "Layer-3 bytes, by direction (to_gateway, from_gateway)", ["direction"],
            registry=r,
        )
        self.l3_drops = Counter("raven_agent_layer3_drops", "Layer-3 packets dropped, by reason", ["reason"],
                                registry=r)
        self.l3_active = Gauge("raven_agent_layer3_active", "1 while a gateway sends this agent its pool's packets",
                               registry=r)
        self.l3_lan_address = Gauge("raven_agent_layer3_lan_address_held",
                                    "1 while this agent's node holds the pool's floating LAN address "
                                    "(layer3.lan_address)", registry=r)
        self.cert_expiry = cert_expiry_gauge(r)
        r.register(GcCollector())
