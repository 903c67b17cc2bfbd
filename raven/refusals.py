"""Refusals as values: one :class:`Refusal` type with a :class:`Reason` code, used by every check.

Every check that says no (the front door, its credentials, the pool check, the agent's check of each OPEN,
the registry's check of each claimed node, the name rule, the gateway's side of the tunnel handshake) raises or
returns a :class:`Refusal`. Its :class:`Reason` is a code, not text: it fixes

- ``where``: which check refused, and so which counter counts it (:class:`Where`);
- ``label``: the counter's ``reason`` label value, a fixed word (dashboards and rules read these; they never
  change with a message's wording, and never carry text a client or a peer chose);
- ``status``: the HTTP status of the answer. For the front door it is the status the client gets; for the agent's
  checks, the status its reset becomes at the gateway (``reset_code``); for a claim the registry refuses, what it
  is as an HTTP answer (invalid input 400, not allowed 403, a conflict 409, a cap 503); for the handshake, the
  status of the tunnel port's answer. The protocol core knows none of this: its own codes (raven/protocol/errors.py)
  are mapped here.

The refusal's ``text`` is for people (the response body, the log line, the agent's log): it says which node and
which pool, and what to do. Code never reads it: control flow and metric labels come from ``reason``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from raven.errors import RavenError
from raven.protocol.errors import HandshakeCode
from raven.protocol.wire import ResetCode


class Where(enum.Enum):
    """Which check refused; each has its own counter (its ``reason`` label takes :attr:`Reason.label`)."""

    FRONT = "front"  # raven_gateway_front_refused_total{reason}
    AGENT = "agent"  # raven_agent_refused_streams_total{reason}
    REGISTRATION = "registration"  # raven_gateway_registration_refusals_total{pool,reason}
    HANDSHAKE = "handshake"  # raven_gateway_handshake_failures_total{reason}


_R = ResetCode


class Reason(enum.Enum):
    """A refusal's code: (where, metric label, HTTP status, reset code for the agent's refusals)."""

    # ---------------------------------------------------------------- front door (gateway/proxy.py, request.py)
    BAD_REQUEST = (Where.FRONT, "bad-request", 400)
    AUTH_REQUIRED = (Where.FRONT, "auth", 401)  # Authorization: Bearer missing or not accepted
    PROXY_AUTH_REQUIRED = (Where.FRONT, "auth", 407)  # Proxy-Authorization missing or not accepted
    DUPLICATE_FIELD = (Where.FRONT, "duplicate-field", 400)  # a credential field sent twice
    PORT = (Where.FRONT, "port", 403)
    UNKNOWN_NODE = (Where.FRONT, "unknown-node", 404)
    METHOD = (Where.FRONT, "method", 405)
    BODY_TIMEOUT = (Where.FRONT, "body-timeout", 408)
    DIRECT_POOL = (Where.FRONT, "direct-pool", 421)  # the node's pool is reached directly or over layer 3
    HEADERS_TOO_LARGE = (Where.FRONT, "headers-too-large", 431)
    UPSTREAM = (Where.FRONT, "upstream", 502)  # the agent or the node answered with an error
    UNAVAILABLE = (Where.FRONT, "unavailable", 503)  # no usable agent, pool without agents, reset by a drain
    NOT_SETTLED = (Where.FRONT, "not-settled", 503)  # a replica that just started: "retry", not "no such node"
    NODE_BUSY = (Where.FRONT, "node-busy", 503)
    CLIENT_SHARE = (Where.FRONT, "client-share", 503)
    CONNECT_CAP = (Where.FRONT, "connect-cap", 503)
    CONNECT_CLIENT_CAP = (Where.FRONT, "connect-client-cap", 503)
    CONNECTION_OVER_CAPACITY = (Where.FRONT, "connection-over-capacity", 503)
    CONNECTION_CLIENT_CAP = (Where.FRONT, "connection-client-cap", 503)
    TIMEOUT = (Where.FRONT, "timeout", 504)
    # Not an answer: the client read none of its response for write_stall_timeout (the response is cut). Its
    # status is what the relay records for a broken response.
    WRITE_STALL = (Where.FRONT, "write-stall", 502)

    # ---------------------------------------------------------------- the agent's check of each OPEN (agent/)
    AGENT_NODE = (Where.AGENT, "node", 502, _R.REFUSED)
    AGENT_PORT = (Where.AGENT, "port", 502, _R.REFUSED)
    AGENT_CONNECT = (Where.AGENT, "connect", 502, _R.REFUSED)
    AGENT_METHOD = (Where.AGENT, "method", 502, _R.REFUSED)
    AGENT_TARGET = (Where.AGENT, "target", 502, _R.REFUSED)
    AGENT_DRAINING = (Where.AGENT, "draining", 503, _R.DRAINING)
    AGENT_QUEUE_FULL = (Where.AGENT, "queue-full", 503, _R.LIMIT)
    AGENT_QUEUE_TIMEOUT = (Where.AGENT, "queue-timeout", 504, _R.TIMEOUT)

    # ---------------------------------------------------------------- the registry's check of each claim
    # The name rule (raven/dns/names.py) first:
    INVALID_NAME = (Where.REGISTRATION, "invalid-name", 400)
    RESERVED_NAME = (Where.REGISTRATION, "reserved-name", 403)
    RESERVED_SUFFIX = (Where.REGISTRATION, "reserved-suffix", 403)
    READS_AS_ADDRESS = (Where.REGISTRATION, "reads-as-address", 400)
    # then the registry (gateway/registry.py):
    INVALID_ADDRESS = (Where.REGISTRATION, "invalid-address", 400)
    DUPLICATE = (Where.REGISTRATION, "duplicate", 400)
    POOL_NOT_ALLOWED = (Where.REGISTRATION, "pool-not-allowed", 403)
    NO_NODE_OBJECT = (Where.REGISTRATION, "no-node-object", 403)
    NODE_OBJECT_POOL = (Where.REGISTRATION, "node-object-pool", 409)
    CONFIG_POOL = (Where.REGISTRATION, "config-pool", 409)  # the gateway's pools.<pool>.nodes lists it elsewhere
    DOTTED_NAME = (Where.REGISTRATION, "dotted-name", 403)
    CLAIMED_BY_OTHER_POOL = (Where.REGISTRATION, "claimed-by-other-pool", 409)
    BOUND_TO_OTHER_POOL = (Where.REGISTRATION, "bound-to-other-pool", 409)
    AGENT_NODE_CAP = (Where.REGISTRATION, "agent-node-cap", 503)
    NODE_CAP = (Where.REGISTRATION, "node-cap", 503)
    HOSTS_BUDGET = (Where.REGISTRATION, "hosts-budget", 503)

    # ---------------------------------------------------------------- the tunnel handshake (gateway/tunnel.py)
    # The labels raven_gateway_handshake_failures_total has always had (dashboards and docs/security.md read
    # them). The ones before the WebSocket upgrade are answered with their status; the others are sent in GOAWAY
    # (their status says what they are). gateway/tunnel.py raises its policy's as :class:`HandshakeRefused`; the
    # core's own codes (raven.protocol.errors.HandshakeCode) are mapped by :func:`handshake_reason`.
    CLIENT_CERTIFICATE_REQUIRED = (Where.HANDSHAKE, "client certificate required", 401)
    UNREADABLE_CLIENT_CERTIFICATE = (Where.HANDSHAKE, "unreadable client certificate", 403)
    NOT_AN_AGENT_CERTIFICATE = (Where.HANDSHAKE, "not-an-agent-certificate", 403)
    # An agent certificate whose agent name, pool or CIDR breaks the rule node names follow (CR LF, escapes...).
    INVALID_IDENTITY = (Where.HANDSHAKE, "invalid-identity", 403)
    GATEWAY_DRAINING = (Where.HANDSHAKE, "gateway is draining", 503)
    NO_HELLO = (Where.HANDSHAKE, "no-hello", 400)
    BAD_HELLO = (Where.HANDSHAKE, "bad-hello", 400)
    HELLO_AGENT_MISMATCH = (Where.HANDSHAKE, "hello-agent-mismatch", 403)
    AGENT_SESSION_CAP = (Where.HANDSHAKE, "agent-session-cap", 503)
    SESSION_CAP = (Where.HANDSHAKE, "session-cap", 503)
    SESSION_RATE = (Where.HANDSHAKE, "session-rate", 429)
    VERSION = (Where.HANDSHAKE, "version", 400)  # no common protocol version
    AGENT_VERSION = (Where.HANDSHAKE, "agent-version", 400)  # below tunnel.min_agent_version
    # Not the handshake, but counted beside it: an agent's REGISTER or ROUTES over its rate (held or ignored).
    REGISTER_RATE = (Where.HANDSHAKE, "register-rate", 429)
    ROUTES_RATE = (Where.HANDSHAKE, "routes-rate", 429)

    def __init__(self, where: Where, label: str, status: int, reset_code: ResetCode | None = None) -> None:
        self.where = where
        self.label = label
        self.status = status
        self.reset_code = reset_code


class Refusal(RavenError):
    """A check said no: ``reason`` is the code (label, status, counter), ``text`` the message for people.

    ``headers`` go out with an HTTP answer (``Allow``, ``Retry-After``, ``WWW-Authenticate``). ``node`` and
    ``pool`` say what the refusal is about where the text alone does not.
    """

    def __init__(self, reason: Reason, text: str, headers: Mapping[str, str] | None = None,
                 node: str = "", pool: str = "") -> None:
        super().__init__(text)
        self.reason = reason
        self.text = text
        self.headers: dict[str, str] = dict(headers or {})
        self.node = node
        self.pool = pool

    @property
    def status(self) -> int:
        return self.reason.status

    @property
    def label(self) -> str:
        return self.reason.label

    @property
    def reset_code(self) -> ResetCode:
        """What the agent resets a refused stream with (REFUSED for the checks that have no other)."""
        return self.reason.reset_code or ResetCode.REFUSED

    def __repr__(self) -> str:
        return f"Refusal({self.reason.name}, {self.text!r})"


class HandshakeRefused(Refusal):
    """The gateway's policy refuses a HELLO (a :class:`Reason` of ``Where.HANDSHAKE``): it is answered with GOAWAY
    and the text. ``key`` is whom the log line is rate-limited by (empty: the peer's address)."""

    def __init__(self, reason: Reason, text: str, *, key: str = "") -> None:
        super().__init__(reason, text)
        self.key = key

    def __repr__(self) -> str:
        return f"HandshakeRefused({self.reason.name}, {self.text!r})"


# The core's handshake codes as the gateway counts them (the agent counts every refusal as one result: its
# raven_agent_connect_attempts_total{result="refused"}, the log line says which).
HANDSHAKE_REASON: Mapping[HandshakeCode, Reason] = {
    HandshakeCode.NO_HELLO: Reason.NO_HELLO,
    HandshakeCode.BAD_HELLO: Reason.BAD_HELLO,
    HandshakeCode.VERSION: Reason.VERSION,
}


def handshake_reason(code: HandshakeCode) -> Reason:
    """The gateway's reason for a handshake its peer broke (a code only an agent meets counts as a bad HELLO)."""
    return HANDSHAKE_REASON.get(code, Reason.BAD_HELLO)


# What the front door answers when a stream is reset before anything reached the client (before HEAD, or before
# the first body bytes): the reset's code picks the reason, and so the status (502, 503 or 504) and the label.
RESET_REASON: Mapping[ResetCode, Reason] = {
    ResetCode.CONNECT_FAILED: Reason.UPSTREAM,
    ResetCode.REFUSED: Reason.UPSTREAM,
    ResetCode.UPSTREAM_BROKEN: Reason.UPSTREAM,
    ResetCode.PROTOCOL: Reason.UPSTREAM,
    ResetCode.INTERNAL: Reason.UPSTREAM,
    ResetCode.FLOW_CONTROL: Reason.UPSTREAM,
    ResetCode.TIMEOUT: Reason.TIMEOUT,
    ResetCode.DRAINING: Reason.UNAVAILABLE,
    ResetCode.LIMIT: Reason.UNAVAILABLE,
    ResetCode.SESSION_CLOSED: Reason.UPSTREAM,
    ResetCode.CANCEL: Reason.UPSTREAM,
}


def reset_reason(code: ResetCode | int) -> Reason:
    """The front door's reason for a stream reset with ``code`` before the response (502 for unknown codes)."""
    try:
        return RESET_REASON[ResetCode(code)]
    except ValueError:
        return Reason.UPSTREAM
