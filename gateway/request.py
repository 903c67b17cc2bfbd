"""A front-end request, parsed and checked without I/O: which node and port it is for, or why it is refused.

Pure functions of the request line and headers (node from the CONNECT authority, the absolute URI or the
Host header; strict ports and names; header blocks that fit the wire), or a :class:`~raven.refusals.Refusal`
whose reason code fixes the status and the metric label, and whose text a user can act on.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from raven.protocol import wire
from raven.protocol.headers import HOP_BY_HOP, RAVEN_PREFIX
from raven.refusals import Reason, Refusal

__all__ = ["Refusal", "Target", "check_header_block", "client_key", "content_length", "filter_headers",
           "header_safe", "parse_target"]

# A request's hop-by-hop headers stay here; so does Expect (the gateway answers 100 Continue itself).
REQUEST_HOP_BY_HOP = HOP_BY_HOP | {"expect"}

_UNSAFE = re.compile(r"[^\x20-\x7e]")


def header_safe(text: str) -> str:
    return _UNSAFE.sub("?", text[:200])


def content_length(value: str | None) -> int | None:
    """Strict: one run of ASCII digits, or None when absent. Raises a :class:`Refusal` (502) when malformed."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise Refusal(Reason.UPSTREAM, f"the agent sent an invalid Content-Length {value[:40]!r}")
    return int(value)


def check_header_block(headers: wire.Headers, limits: wire.Limits) -> None:
    """The headers must fit the wire format: ISO-8859-1 text and a bounded block (else 400/431)."""
    size = 2
    for name, value in headers:
        try:
            size += 4 + len(name.encode("latin-1")) + len(value.encode("latin-1"))
        except UnicodeEncodeError:
            raise Refusal(Reason.BAD_REQUEST, f"header {name[:60]!r} has characters outside ISO-8859-1") from None
    if len(headers) > limits.max_headers:
        raise Refusal(Reason.HEADERS_TOO_LARGE, f"{len(headers)} request headers, limit {limits.max_headers}")
    if size > limits.max_header_bytes:
        raise Refusal(Reason.HEADERS_TOO_LARGE, f"request headers take {size} bytes, limit {limits.max_header_bytes}")


@dataclass(frozen=True, slots=True)
class Target:
    node: str
    port: int
    path: str  # origin-form request target (path and query)
    kind: wire.StreamKind


def filter_headers(pairs: Any, drop_extra: frozenset[str] = frozenset()) -> wire.Headers:
    """Drop hop-by-hop headers, those named by Connection, and Raven's own routing headers."""
    named: set[str] = set()
    for name, value in pairs:
        if name.lower() == "connection":
            named.update(t.strip().lower() for t in value.split(","))
    out = []
    for name, value in pairs:
        low = name.lower()
        if low in REQUEST_HOP_BY_HOP or low in named or low in drop_extra or low.startswith(RAVEN_PREFIX):
            continue
        out.append((name, value))
    return tuple(out)


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    host, sep, port_text = authority.rpartition(":")
    if not sep or "]" in port_text:
        host, port_text = authority, ""
    if not port_text:
        if default_port is None:
            raise Refusal(Reason.BAD_REQUEST, f"{authority!r} has no port")
        port = default_port
    elif port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise Refusal(Reason.BAD_REQUEST, f"bad port in {authority!r}")
    node = host.lower().removesuffix(".")  # one trailing dot: the absolute form of the same name
    if not wire.valid_node_name(node):
        raise Refusal(Reason.BAD_REQUEST, f"{host!r} is not a valid node name")
    return node, port


def parse_target(request: web.BaseRequest) -> Target:
    """Find the node and port: CONNECT authority, absolute URI, or Host header."""
    raw = request.raw_path
    if request.method == "CONNECT":
        node, port = _split_authority(raw, None)
        return Target(node, port, "", wire.StreamKind.TCP)
    if raw.startswith(("http://", "https://")):
        parts = urlsplit(raw)
        if parts.scheme != "http":
            raise Refusal(Reason.BAD_REQUEST, "https:// targets must be reached with CONNECT")
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        node, port = _split_authority(parts.netloc.rpartition("@")[2], 80)
        return Target(node, port, path, wire.StreamKind.HTTP)
    host = request.headers.get("Host")
    if not host:
        raise Refusal(Reason.BAD_REQUEST, "request has no Host header: cannot tell which node it is for")
    if not raw.startswith("/"):
        raise Refusal(Reason.BAD_REQUEST, f"unsupported request target {raw[:60]!r}")
    node, port = _split_authority(host, 80)
    return Target(node, port, raw, wire.StreamKind.HTTP)


def client_key(address: str) -> str:
    """The fairness key sent to the agent: stable for one client address across replicas, not the address."""
    return hashlib.blake2b(address.encode(), digest_size=8).hexdigest()
