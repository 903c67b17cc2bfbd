"""HTTP/1.1 requests in, response heads out, without I/O: the lean front end's parsing decisions.

:class:`RequestReader` feeds a connection's bytes to llhttp (httptools; strict mode) and keeps the requests it
completes, in order (pipelining), each with its body as it arrives. What llhttp refuses, a request does not
get past: a Content-Length beside a Transfer-Encoding, a duplicate or malformed Content-Length, a
Transfer-Encoding other than ``chunked`` last, obs-fold (a header line that starts with whitespace), a bare LF
where CRLF belongs, control bytes in a name. On top, as aiohttp's server did: a second Host (or another field
that must be single), a request line or header field longer than ``max_field`` bytes, and a request head longer
than ``max_head`` bytes in all (the reader stops taking bytes there: a head cannot grow the buffers).

:func:`response_head` serializes a response head; :func:`canned` a whole short answer that closes the
connection (a refusal before any request could be handled).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["BadRequest", "ParsedRequest", "RequestReader", "canned", "response_head"]

# Fields a request may carry once (aiohttp's server refused a second one of these too).
_SINGLE = frozenset({b"host", b"content-length", b"content-location", b"content-range", b"content-type", b"etag",
                     b"max-forwards", b"server", b"transfer-encoding", b"user-agent"})

_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 407: "Proxy Authentication Required",
            408: "Request Timeout", 413: "Content Too Large", 429: "Too Many Requests",
            431: "Request Header Fields Too Large", 499: "Client Closed Request", 500: "Internal Server Error",
            502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


class BadRequest(Exception):
    """The client's bytes are not an HTTP/1.1 request this server takes: ``status`` and why, in words."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(slots=True, eq=False)
class ParsedRequest:
    """A request head, and its body as it comes (``chunks``, ``done`` once the message is complete)."""

    method: str
    target: str
    version: tuple[int, int]
    headers: CIMultiDictProxy[str]
    keep_alive: bool
    has_body: bool
    expect_continue: bool
    chunks: deque[bytes] = field(default_factory=deque)
    buffered: int = 0  # body bytes in chunks
    done: bool = False  # the whole message (body included) arrived
    tunnel: bytes | None = None  # CONNECT: the bytes after its head (the tunnel's first), once it completed


class RequestReader:
    """A connection's requests as llhttp parses them: :attr:`ready` holds each head once complete, in order."""

    __slots__ = ("_current", "_fields", "_head_bytes", "_name_seen", "_parser", "_trailer_bytes", "_url", "in_head",
                 "max_field", "max_head", "ready", "tunnel", "upgraded")

    def __init__(self, max_field: int, max_head: int) -> None:
        self.max_field = max_field
        self.max_head = max_head
        self.ready: deque[ParsedRequest] = deque()
        self.tunnel = False  # a CONNECT completed: the bytes after it are not HTTP
        self.in_head = False  # a head has begun and is not complete yet
        self.upgraded: ParsedRequest | None = None  # the CONNECT request whose tunnel bytes follow
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._name_seen: set[bytes] = set()
        self._head_bytes = 0
        self._trailer_bytes = 0
        self._current: ParsedRequest | None = None

    def feed(self, data: bytes) -> None:
        """Take the connection's next bytes; raises :class:`BadRequest` (the connection ends after its answer)."""
        while True:
            if self.tunnel:  # after a CONNECT: the tunnel's bytes, held until the handler takes the connection over
                if self.upgraded is not None:
                    self.upgraded.tunnel = (self.upgraded.tunnel or b"") + data
                return
            if self.in_head or self._current is None:
                self._head_bytes += len(data)  # counted generously: bytes after the head's end are counted too
                if self._head_bytes > self.max_head and not self._ends_head(data):
                    raise BadRequest(431, f"request head longer than {self.max_head} bytes")
            try:
                self._parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as upgrade:
                offset = upgrade.args[0] if upgrade.args and isinstance(upgrade.args[0], int) else len(data)
                last = self.ready[-1] if self.ready else None
                if last is None or last.method != "CONNECT":
                    # An Upgrade offer (curl's h2c): answered as the HTTP/1.1 request it also is. llhttp stops at
                    # its head and skips a body it has: that body would be read as the next request (smuggled
                    # past a proxy that frames by Content-Length), so an offer with a body is refused.
                    if last is not None and last.has_body:
                        raise BadRequest(400, "an Upgrade offer with a request body is not taken") from None
                    self._parser = httptools.HttpRequestParser(self)  # a new parser reads on (a loop, not a
                    data = data[offset:]  # recursion: one read may hold thousands of offers)
                    continue
                self.tunnel = True
                last.tunnel = data[offset:]
                self.upgraded = last
                return
            except httptools.HttpParserError as exc:
                if isinstance(exc.__context__, BadRequest):  # raised by a callback below: llhttp wraps it
                    raise exc.__context__ from None
                raise BadRequest(400, str(exc) or "malformed request") from None

    def _ends_head(self, data: bytes) -> bool:
        # The head's end may be in these bytes, followed by its body: allowed when the head itself fits.
        end = data.find(b"\r\n\r\n")
        return end >= 0 and self._head_bytes - len(data) + end + 4 <= self.max_head

    # ------------------------------------------------------------ llhttp's callbacks

    def on_message_begin(self) -> None:
        self.in_head = True
        self._url = b""
        self._fields = []
        self._name_seen = set()
        self._current = None
        self._trailer_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.max_field:
            raise BadRequest(400, f"request target longer than {self.max_field} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self.max_field:
            raise BadRequest(400, f"header field longer than {self.max_field} bytes")
        if not self.in_head:  # a trailer (after a chunked body): not kept, not relayed, bounded as a head is
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > self.max_head:
                raise BadRequest(431, f"request trailers longer than {self.max_head} bytes")
            return
        lower = name.lower()
        if lower in _SINGLE:
            if lower in self._name_seen:
                raise BadRequest(400, f"duplicate {name.decode('latin-1')!r} header")
            self._name_seen.add(lower)
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        headers: CIMultiDict[str] = CIMultiDict()
        for name, value in self._fields:
            # As aiohttp's parser: UTF-8, bytes that are not kept as surrogates (a header outside ISO-8859-1
            # is then refused with its name by the front end, gateway/request.py's check_header_block).
            headers.add(name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        self._fields = []
        method = parser.get_method().decode("ascii", "replace")
        major, minor = parser.get_http_version().split(".")
        has_body = b"content-length" in self._name_seen or b"transfer-encoding" in self._name_seen
        if method == "CONNECT":
            has_body = False
        request = ParsedRequest(
            method, self._url.decode("utf-8", "surrogateescape"), (int(major), int(minor)), CIMultiDictProxy(headers),
            bool(parser.should_keep_alive()), has_body,
            has_body and headers.get("Expect", "").lower() == "100-continue")
        if headers.get("Content-Length") == "0":
            request.has_body = request.expect_continue = False
        self._current = request
        self.in_head = False
        self._head_bytes = 0
        self.ready.append(request)

    def on_body(self, body: bytes) -> None:
        current = self._current
        if current is not None:
            current.chunks.append(body)
            current.buffered += len(body)

    def on_message_complete(self) -> None:
        if self._current is not None:
            self._current.done = True


def response_head(status: int, reason: str, headers: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> bytes:
    """``HTTP/1.1 status reason`` and the header lines, latin-1, ending with the empty line."""
    lines = [f"HTTP/1.1 {status} {reason or _REASONS.get(status, 'Unknown')}"]
    for name, value in headers:
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1", "replace")


def canned(status: int, reason: str, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole short plain-text answer that closes the connection, its reason in the body and a header."""
    body = f"raven: {reason}\n".encode("utf-8", "replace")
    safe = "".join(c if " " <= c <= "~" else "?" for c in reason[:200])
    return response_head(status, "", (("Content-Type", "text/plain; charset=utf-8"),
                                      ("Content-Length", str(len(body))), ("Connection", "close"),
                                      ("X-Raven-Error", safe), *extra)) + body
