"""Gzip a node's response before the uplink, for a client that accepts it: a tenth of the bytes leave the site.

An exporter's text page (dcgm-exporter: ~50 KiB for 8 GPUs, the same label sets over and over) compresses
about fifteenfold at zlib level 1, in well under a tenth of a millisecond. Prometheus sends
``Accept-Encoding: gzip`` by default and decodes what it gets, so what reaches it decodes to exactly the
exporter's bytes.

When (:func:`plan`): the agent's ``compress`` setting is ``always``, or ``auto`` and the gateway did not say
the pool's uplink is free (a hint of the OPEN's terms, from the gateway's ``pools.<pool>.compress``); the client
accepts gzip (``Accept-Encoding``: ``gzip``/``x-gzip`` or ``*`` with a q-value above 0); the request is not
HEAD; the status carries a body (not 1xx, 204, 206, 304); the node did not encode the body itself (no
``Content-Encoding`` other than ``identity``: nothing is compressed twice); it did not forbid changes
(``Cache-Control: no-transform``); and it is not known to be tiny (a ``Content-Length`` under
:data:`MIN_BYTES`). The head then says ``Content-Encoding: gzip`` and ``Vary: Accept-Encoding``, drops
``Content-Length`` (the gateway sends the body chunked) and weakens a strong ``ETag``.

How (:class:`Gzip`): chunk by chunk with ISA-L's ``compressobj(level=1, wbits=31)`` (python-isal; the
standard library's zlib where it is missing: the same API and output format, twice the CPU); a sync flush every
:data:`FLUSH_BYTES` of input, so that the compressor never holds more than that plus its window (bounded
memory, bytes keep moving on a long body); the gzip trailer with the last piece. What zlib hands out
between two flushes (the 10-byte gzip header at once, then a block now and then) is held and sent with the
flush: one tunnel frame per flush, so a 50 KB page crosses as one DATA frame, not as a header frame and
the rest. A body that breaks mid-way
is reset by the caller as before: the client sees a broken response, never a complete gzip stream.
"""

from __future__ import annotations

from typing import Any, Literal

from raven.http.coding import accepts_gzip, deflate

__all__ = ["FLUSH_BYTES", "LEVEL", "MIN_BYTES", "Gzip", "accepts_gzip", "plan"]
from raven.protocol import wire

Mode = Literal["auto", "always", "never"]
LEVEL = 1  # on exporter text, level 1 is within a few per cent of level 6's size at a third of the CPU (either library)
MIN_BYTES = 1024  # a known length under this is sent as is: gzip's 18 bytes of framing would eat the gain
FLUSH_BYTES = 64 * 1024  # input between sync flushes
_NO_BODY_STATUS = frozenset({204, 206, 304})


def _values(headers: wire.Headers, name: str) -> list[str]:
    return [v for n, v in headers if n.lower() == name]


def plan(mode: Mode, method: str, status: int, request_headers: wire.Headers,
         response_headers: wire.Headers, uplink_free: bool = False) -> tuple[Gzip | None, wire.Headers]:
    """Whether to gzip this response, and the head to send: ``(Gzip(), new head)`` or ``(None, head unchanged)``.

    ``request_headers`` are the request's, ``response_headers`` the node's (hop-by-hop ones already dropped);
    ``uplink_free`` the gateway's hint (raven.protocol.terms_of: the pool's uplink is free).
    """
    if mode == "never" or method == "HEAD" or status < 200 or status in _NO_BODY_STATUS:
        return None, response_headers
    if mode == "auto" and uplink_free:
        return None, response_headers
    if not accepts_gzip(_values(request_headers, "accept-encoding")):
        return None, response_headers
    if any(v.strip().lower() not in ("", "identity") for v in _values(response_headers, "content-encoding")):
        return None, response_headers  # the node encoded it already
    if any("no-transform" in v.lower() for v in _values(response_headers, "cache-control")):
        return None, response_headers
    lengths = _values(response_headers, "content-length")
    if lengths and lengths[0].strip().isdigit() and int(lengths[0].strip()) < MIN_BYTES:
        return None, response_headers
    out: list[tuple[str, str]] = []
    vary_done = False
    for name, value in response_headers:
        low = name.lower()
        if low in ("content-length", "content-encoding"):
            continue
        if low == "vary":
            tokens = {t.strip().lower() for t in value.split(",")}
            if "accept-encoding" not in tokens and "*" not in tokens:
                value = f"{value}, Accept-Encoding"
            vary_done = True
        elif low == "etag" and not value.lstrip().startswith("W/"):
            value = "W/" + value.strip()  # a strong validator names these exact bytes, which change
        out.append((name, value))
    out.append(("Content-Encoding", "gzip"))
    if not vary_done:
        out.append(("Vary", "Accept-Encoding"))
    return Gzip(), tuple(out)


class Gzip:
    """One response's streaming gzip encoder; counts the bytes in (``raw``) and out (``wire``)."""

    __slots__ = ("_flush", "_held", "_pending", "_z", "raw", "wire")

    def __init__(self, level: int = LEVEL, library: Any = None) -> None:
        lib = deflate if library is None else library  # ``library``: another zlib-like module (the benchmark's)
        self._flush = (lib.Z_SYNC_FLUSH, lib.Z_FINISH)
        self._z = lib.compressobj(level, lib.DEFLATED, 31)  # wbits 31: gzip framing, 32 KiB window
        self._pending = 0  # input since the last flush
        self._held: list[bytes] = []  # output since the last flush (at most what FLUSH_BYTES of input make)
        self.raw = 0
        self.wire = 0

    def feed(self, chunk: bytes, last: bool) -> bytes:
        """Compress one piece of the body; with ``last``, end the gzip stream. May return b"" (not the last)."""
        self.raw += len(chunk)
        if chunk:
            part = self._z.compress(chunk)
            if part:
                self._held.append(part)
        self._pending += len(chunk)
        if last:
            self._held.append(self._z.flush(self._flush[1]))
        elif self._pending >= FLUSH_BYTES:
            self._held.append(self._z.flush(self._flush[0]))
            self._pending = 0
        else:
            return b""
        out = b"".join(self._held)
        self._held.clear()
        self.wire += len(out)
        return out
