"""What every frame shares: the 6-byte header, the frame types, stream kinds and reset codes, the decoder's
limits and error, the header-block codec of OPEN and HEAD, and a bounds-checked reader. No I/O."""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass

from raven.errors import RavenError
from raven.logsafe import escape

PROTOCOL_VERSION = 3  # what a gateway chooses when the agent offers it
SUPPORTED_VERSIONS: tuple[int, ...] = (1, 2, 3)
BATCHED_FROM = 2  # the first version whose messages carry length-prefixed frames
FIELDS_FROM = 3  # the first version whose OPEN carries the request's terms as fields (deadline, client key, hints)

HEADER = struct.Struct("!BBI")
HEADER_SIZE = HEADER.size
FLAG_FIN = 0x01
FLAG_FIELDS = 0x02  # OPEN only (version 3): the payload ends with the request's terms (frames/streams.py)

U16 = struct.Struct("!H")
U32 = struct.Struct("!I")
U64 = struct.Struct("!Q")
BATCHED_HEADER = struct.Struct("!IBBI")  # length prefix, then the frame header: the data path's one pack

MAX_STREAM_ID = 2**32 - 1
MAX_WINDOW_INCREMENT = 2**31 - 1
MAX_REFUSAL_REASON = 300  # characters of one registration refusal's reason
MAX_ROUTES = 1024  # CIDRs in one ROUTES frame
MAX_RELEASE = 64  # characters of the release a peer announces in HELLO/WELCOME
MAX_DEADLINE_MS = 86_400_000  # an OPEN's deadline field: at most a day (0: none given, the agent's own applies)
MAX_CLIENT_KEY = 32  # characters of an OPEN's client (fairness) key: [A-Za-z0-9_-]
MAX_SESSION_ID = 64  # characters of HELLO's session id: [A-Za-z0-9_-] (agents send a UUID's 32 hex digits)

TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_NODE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*\Z")
_BAD_VALUE = re.compile(rb"[\x00\r\n]")
_SESSION_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_SESSION_ID}}}\Z")


class FrameType(enum.IntEnum):
    # control frames, stream 0
    HELLO = 0x01
    WELCOME = 0x02
    REGISTER = 0x03
    REGISTERED = 0x04
    PING = 0x05
    PONG = 0x06
    DRAIN = 0x07
    GOAWAY = 0x08
    DATAGRAM = 0x09  # layer 3: one IP packet, version 2 sessions only
    ROUTES = 0x0A  # layer 3: the CIDRs a side announces (agent) or carries (gateway), JSON
    # stream frames, stream id > 0
    OPEN = 0x10
    HEAD = 0x11
    DATA = 0x12
    END = 0x13
    RESET = 0x14
    WINDOW = 0x15


CONTROL_TYPES = frozenset(
    {
        FrameType.HELLO,
        FrameType.WELCOME,
        FrameType.REGISTER,
        FrameType.REGISTERED,
        FrameType.PING,
        FrameType.PONG,
        FrameType.DRAIN,
        FrameType.GOAWAY,
        FrameType.DATAGRAM,
        FrameType.ROUTES,
    }
)
# The flags each frame type may carry; any other bit is an error.
ALLOWED_FLAGS: dict[FrameType, int] = {
    FrameType.OPEN: FLAG_FIN | FLAG_FIELDS, FrameType.HEAD: FLAG_FIN, FrameType.DATA: FLAG_FIN,
}


class StreamKind(enum.IntEnum):
    HTTP = 1
    TCP = 2
    BACKFILL = 3  # the gateway asks the agent for scrapes it kept through an outage (raven/protocol/backfill.py)


class ResetCode(enum.IntEnum):
    """Why a stream ended abnormally. The gateway maps these to HTTP statuses."""

    CANCEL = 1  # the requester went away or gave up
    REFUSED = 2  # the agent will not serve this node/port (not its own, not allowed)
    CONNECT_FAILED = 3  # the agent could not reach the node's port
    TIMEOUT = 4  # a deadline passed on the far side
    PROTOCOL = 5  # malformed or out-of-order frame on this stream
    FLOW_CONTROL = 6  # the peer sent more than its credit
    INTERNAL = 7  # a bug or unexpected failure on the far side
    UPSTREAM_BROKEN = 8  # the exporter's response broke mid-body
    DRAINING = 9  # the agent is draining: retry elsewhere
    LIMIT = 10  # too many streams
    SESSION_CLOSED = 11  # the session carrying the stream ended


class ProtocolError(RavenError):
    """Malformed input. ``stream_id`` is 0 when the whole session must end."""

    def __init__(self, reason: str, stream_id: int = 0, code: ResetCode = ResetCode.PROTOCOL) -> None:
        super().__init__(reason)
        self.reason = reason
        self.stream_id = stream_id
        self.code = code


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds the decoder enforces. Both peers use the same defaults."""

    max_frame: int = 1 << 20  # whole message, control frames included (a message of exactly this size is fine)
    max_data: int = 64 * 1024  # payload of one DATA frame
    max_header_bytes: int = 64 * 1024  # encoded header block of OPEN/HEAD
    max_headers: int = 256
    max_reason: int = 1024


DEFAULT_LIMITS = Limits()

Headers = tuple[tuple[str, str], ...]


def valid_node_name(name: str) -> bool:
    """RFC 1123 host name, lower case, at most 253 characters."""
    return 0 < len(name) <= 253 and _NODE_NAME.match(name) is not None


def valid_pool_name(name: str) -> bool:
    """A pool name: one RFC 1123 label (a node name without dots), at most 63 characters."""
    return "." not in name and valid_node_name(name)


def valid_session_id(session: str) -> bool:
    """HELLO's session id: 1..MAX_SESSION_ID characters of ``[A-Za-z0-9_-]``."""
    return _SESSION_ID.match(session) is not None


def peer_text(raw: bytes | memoryview, limit: int) -> str:
    """Free text a peer chose (the reason of a RESET, GOAWAY or DRAIN) as it may be kept and shown: UTF-8 (bad
    bytes replaced), control characters escaped by raven/logsafe.py's rule (so that no log line, ``raven status``
    table or status page shows a terminal escape or a line of the peer's making), at most ``limit`` characters."""
    return escape(bytes(raw).decode("utf-8", "replace"))[:limit]


def header(ftype: FrameType, flags: int, stream_id: int) -> bytes:
    return HEADER.pack(ftype, flags, stream_id)


def short_str(text: str, what: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"{what} longer than 255 bytes")
    return bytes((len(raw),)) + raw


# ---------------------------------------------------------------- the header block of OPEN and HEAD


def check_headers(headers: Headers, stream_id: int) -> None:
    for name, value in headers:
        if not TOKEN.match(name.encode("latin-1", "replace")):
            raise ProtocolError(f"invalid header name {name[:40]!r}", stream_id)
        if _BAD_VALUE.search(value.encode("latin-1", "replace")):
            raise ProtocolError(f"invalid value for header {name[:40]!r}", stream_id)


def encode_headers(headers: Headers) -> bytes:
    parts = [U16.pack(len(headers))]
    for name, value in headers:
        n = name.encode("latin-1")
        v = value.encode("latin-1")
        parts.append(U16.pack(len(n)))
        parts.append(n)
        parts.append(U16.pack(len(v)))
        parts.append(v)
    return b"".join(parts)


def decode_headers(r: Reader, limits: Limits) -> Headers:
    start = r.pos
    count = r.u16("header count")
    if count > limits.max_headers:
        raise ProtocolError(f"{count} headers, limit {limits.max_headers}", r.stream_id)
    # The Reader's checks, inlined: this runs for every request's OPEN and every response's HEAD, and a method
    # call per length and per string was most of its cost.
    buf, pos, size, sid = r.buf, r.pos, len(r.buf), r.stream_id
    unpack, max_bytes = U16.unpack_from, limits.max_header_bytes
    out: list[tuple[str, str]] = []
    for _ in range(count):
        if pos + 2 > size:
            raise ProtocolError("truncated header name length", sid)
        end = pos + 2 + unpack(buf, pos)[0]
        if end > size:
            raise ProtocolError("truncated header name", sid)
        name_raw = bytes(buf[pos + 2 : end])
        if not TOKEN.match(name_raw):
            raise ProtocolError(f"invalid header name {name_raw[:40]!r}", sid)
        pos = end
        if pos + 2 > size:
            raise ProtocolError("truncated header value length", sid)
        end = pos + 2 + unpack(buf, pos)[0]
        if end > size:
            raise ProtocolError("truncated header value", sid)
        value_raw = bytes(buf[pos + 2 : end])
        if _BAD_VALUE.search(value_raw):
            raise ProtocolError(f"invalid value for header {name_raw[:40]!r}", sid)
        pos = end
        out.append((name_raw.decode("latin-1"), value_raw.decode("latin-1")))
        if pos - start > max_bytes:
            raise ProtocolError(f"header block over {max_bytes} bytes", sid)
    r.pos = pos
    return tuple(out)


class Reader:
    """Bounds-checked cursor over one payload."""

    __slots__ = ("buf", "pos", "stream_id")

    def __init__(self, buf: memoryview, stream_id: int) -> None:
        self.buf = buf
        self.pos = 0
        self.stream_id = stream_id

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise ProtocolError(f"truncated {what}", self.stream_id)
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u16(self, what: str) -> int:
        return int(U16.unpack(self.take(2, what))[0])

    def text(self, n: int, what: str, encoding: str = "latin-1") -> str:
        raw = self.take(n, what)
        try:
            return bytes(raw).decode(encoding)
        except UnicodeDecodeError:
            raise ProtocolError(f"{what} is not valid {encoding}", self.stream_id) from None

    def done(self, what: str) -> None:
        if self.pos != len(self.buf):
            raise ProtocolError(f"{len(self.buf) - self.pos} trailing bytes after {what}", self.stream_id)
