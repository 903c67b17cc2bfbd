"""A front-end request, parsed and checked without I/O: which node and port it is for, or why it is refused.

Pure functions of the request line and headers (node from the CONNECT authority, the absolute URI or the
Host header; strict ports and names; header blocks that fit the wire), or a :class:`~raven.refusals.Refusal`
whose reason code fixes the status and the metric label, and whose text a user can act on.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from multidict import CIMultiDictProxy

from raven.protocol import wire
from raven.refusals import Reason, Refusal

__all__ = ["Refusal", "Target", "check_header_block", "client_key", "content_length", "header_safe", "parse_target"]

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


class RequestLine(Protocol):
    """What the target is read from: a front-end request (raven/http/call.py's, or aiohttp's)."""

    @property
    def method(self) -> str: ...

    @property
    def raw_path(self) -> str: ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...


@dataclass(frozen=True, slots=True)
class Target:
    node: str
    port: int
    path: str  # origin-form request target (path and query)
    kind: wire.StreamKind


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


def parse_target(request: RequestLine) -> Target:
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


@functools.lru_cache(maxsize=4096)  # computed per request otherwise; a fleet has a few scrapers, and it is bounded
def client_key(address: str) -> str:
    """The fairness key sent to the agent: stable for one client address across replicas, not the address."""
    return hashlib.blake2b(address.encode(), digest_size=8).hexdigest()
