"""The HTTP side of the tunnel contract, in one place: which headers never cross, which are Raven's own, and
the one filter both ends apply.

Both ends use :func:`filter_headers`: the gateway when it turns a client's request into an OPEN and a node's
response into the client's answer, the agent when it turns an OPEN into the node's request (it checks again: it
does not trust its gateway) and the node's answer into a HEAD. The request's terms (deadline, client key,
hints) are OPEN's fields from version 3; raven/protocol/terms.py carries them as the ``x-raven-*`` headers
below to a peer of an older version.
"""

from __future__ import annotations

from collections.abc import Collection

from raven.protocol.frames.base import Headers

# Hop-by-hop: they describe one connection, never the message (RFC 9110 section 7.6.1, plus the legacy
# Keep-Alive and Proxy-Connection). Headers named by a Connection header are hop-by-hop too.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade",
})
# How a body is framed on one connection: each end frames what it sends itself.
FRAMING = frozenset({"content-length", "transfer-encoding"})
# What a client says about where a request came from is not believed: the gateway drops these and sets
# X-Forwarded-For / X-Forwarded-Proto from what it saw.
FORWARDED = frozenset({
    "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-port", "x-forwarded-proto", "x-real-ip",
})

# Methods a client may send again after a failure without changing the outcome (RFC 9110 section 9.2.2): the
# gateway retries such a request once on another agent when it failed before its response head, and the agent
# once on a fresh connection when a reused one to the node died before answering; neither when it has a body.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})

# Raven's own headers: a client's are dropped at the gateway, a node's at the agent; the agent forwards none to
# the node. Under protocol versions 1 and 2 the gateway states the request's terms in these three (version 3:
# OPEN's fields, and the agent ignores any x-raven-* header).
RAVEN_PREFIX = "x-raven-"
DEADLINE_HEADER = "x-raven-timeout-ms"  # gateway -> agent: milliseconds left for this request
CLIENT_HEADER = "x-raven-client"  # gateway -> agent: the fairness key (a hash of the client address)
COMPRESS_HEADER = "x-raven-compress"  # gateway -> agent: "0" when the pool's uplink is free (pools.<p>.compress)


def filter_headers(pairs: Collection[tuple[str, str]], drop: Collection[str] = frozenset()) -> Headers:
    """The one header filter: ``pairs`` without hop-by-hop headers, those a Connection header names, Raven's own
    (``x-raven-*``) and those named in ``drop`` (lower case)."""
    # One pass (this runs twice a request): each name is lowered once; the names a Connection header lists are
    # taken out afterwards (that header is rare: HTTP/1.1 keep-alive needs none).
    named: set[str] | None = None
    out = []
    for name, value in pairs:
        low = name.lower()
        if low in HOP_BY_HOP or low in drop or low.startswith(RAVEN_PREFIX):
            if low == "connection":
                if named is None:
                    named = set()
                named.update(t.strip().lower() for t in value.split(","))
            continue
        out.append((name, value))
    if named:
        return tuple(pair for pair in out if pair[0].lower() not in named)
    return tuple(out)
