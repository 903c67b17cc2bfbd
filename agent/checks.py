"""What the agent accepts from its gateway: every OPEN is checked again here, whatever the gateway checked.

A compromised or buggy gateway must not turn the agent into an open proxy into the edge network. So the
address comes only from the agent's inventory, the port only from its allowlist, the method only from its
allowlist, and the request target must be origin-form (else a :class:`~raven.refusals.Refusal` whose reason
fixes the metric label and the reset code). The upstream URL is built from those parts with yarl
(never by pasting strings) and checked once more before anything is dialled. No I/O: the request's deadline
starts (raven/deadline.py, the one clock) as its OPEN is checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from yarl import URL

from raven.deadline import Deadline
from raven.hostport import url_host
from raven.protocol import FRAMING, filter_headers, terms_of, wire
from raven.refusals import Reason, Refusal

MAX_TARGET = 8192
# Origin-form (RFC 9112 section 3.2.1): an absolute path and an optional query, printable ASCII without
# spaces; no fragment, no backslash (some servers read it as '/').
# The query may also hold "[" and "]" as clients send them unencoded (Prometheus's params such as collect[]).
_ORIGIN_FORM = re.compile(r"/(?!/)[!$&'()*+,\-./0-9:;=@A-Z_a-z~%]*(\?[!$&'()*+,\-./0-9:;=?@A-Z_a-z~%\[\]]*)?")

@dataclass(frozen=True, slots=True)
class Request:
    """An OPEN that passed every check: what to dial and what to send."""

    url: URL  # built from the inventory address, the allowed port and the checked target
    address: str
    headers: wire.Headers  # without Raven's own and without framing headers
    deadline: Deadline  # the gateway's (never longer than the agent's own), from the OPEN: every wait spends it
    client: str  # fairness key ("-" when the gateway sent none)
    uplink_free: bool = False  # the gateway says the pool's uplink is free: no gzip under compress "auto"


@dataclass(frozen=True, slots=True)
class Policy:
    allowed_ports: frozenset[int]
    allowed_methods: frozenset[str]
    allow_connect: bool
    request_timeout: float  # seconds: the deadline when the gateway states none, and the longest it may state


def check_open(frame: wire.Open, address: str | None, policy: Policy) -> Request:
    """Check one OPEN against the agent's own inventory address and policy; raise :class:`Refusal`.

    The request's ``deadline`` is made here, once, from the deadline the OPEN states: every wait of the agent for
    this request spends it.
    """
    node = frame.node
    if address is None:
        raise Refusal(Reason.AGENT_NODE, f"node {node!r} is not served by this agent")
    if frame.port not in policy.allowed_ports:
        raise Refusal(Reason.AGENT_PORT, f"port {frame.port} is not allowed on this agent")
    if frame.kind == wire.StreamKind.TCP:
        if not policy.allow_connect:
            raise Refusal(Reason.AGENT_CONNECT, "CONNECT (raw TCP) is not enabled on this agent")
    elif frame.method not in policy.allowed_methods:
        raise Refusal(Reason.AGENT_METHOD, f"method {frame.method[:20]!r} is not allowed on this agent")
    # The gateway's terms (OPEN's fields from version 3, else its x-raven-* headers), within the agent's bounds: a
    # deadline no longer than its own timeout, a key the codec has bounded.
    terms = terms_of(frame)
    client = terms.client or "-"
    if frame.kind == wire.StreamKind.TCP:
        return Request(URL.build(scheme="tcp", host=address, port=frame.port), address, (),
                       Deadline.stated(terms.deadline_ms, policy.request_timeout), client)
    target = frame.target
    if len(target) > MAX_TARGET:
        raise Refusal(Reason.AGENT_TARGET, f"request target of {len(target)} characters (limit {MAX_TARGET})")
    if not _ORIGIN_FORM.fullmatch(target):
        raise Refusal(Reason.AGENT_TARGET, f"request target {target[:80]!r} is not origin-form (/path?query)")
    path, _, query = target.partition("?")
    # Already encoded parts: an IPv6 address must come bracketed then (yarl brackets it only when it encodes).
    url = URL.build(scheme="http", host=url_host(address), port=frame.port, path=path, query_string=query, encoded=True)
    # Belt and braces: whatever the target held, the URL goes to the inventory address and allowed port only.
    if url.host != address.strip("[]") or url.port != frame.port or url.user is not None:
        raise Refusal(Reason.AGENT_TARGET, f"request target {target[:80]!r} would leave node {node!r}")
    # Headers from the gateway that never reach the node: hop-by-hop ones, Raven's own (raven.protocol's one filter)
    # and the framing (the agent's HTTP client frames the body it sends itself; a gateway must not choose it).
    return Request(url, address, filter_headers(frame.headers, FRAMING),
                   Deadline.stated(terms.deadline_ms, policy.request_timeout), client, terms.uplink_free)
