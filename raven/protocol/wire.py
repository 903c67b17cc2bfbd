"""The Raven tunnel wire format: a pure codec with no I/O.

Version 1: one binary WebSocket message carries exactly one frame. Version 2 (batched): a message carries one
or more frames, each preceded by its length (u32, big-endian), so a sender writes everything it has in one
message per turn of its event loop. The frame itself is the same in both versions::

    +--------+--------+--------------------------------+-----------------+
    | type 8 | flags 8|        stream id 32 (BE)       | payload ...     |
    +--------+--------+--------------------------------+-----------------+

The payload length is the frame's length (the message's in version 1) minus the 6-byte header. Stream 0 carries
control frames; every other id names one stream. ``decode`` turns a message into one
frame object or raises :class:`ProtocolError`; ``encode`` does the reverse. Nothing here
touches a socket, a clock or a task, so the codec is easy to test and fuzz.
See ``docs/protocol.md`` for the full specification.

Why this module is long and not split: it is one frame type after another, each encoder beside its decoder so
that the two stay in step; splitting by frame kind would put an encoder and its decoder's shared limits in
different files.
"""

from __future__ import annotations

import enum
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raven.errors import RavenError

PROTOCOL_VERSION = 2  # what a gateway chooses when the agent offers it
SUPPORTED_VERSIONS = (1, 2)
BATCHED_FROM = 2  # the first version whose messages carry length-prefixed frames

HEADER = struct.Struct("!BBI")
HEADER_SIZE = HEADER.size
FLAG_FIN = 0x01

_U16 = struct.Struct("!H")
_BATCHED_HEADER = struct.Struct("!IBBI")  # length prefix, then the frame header: the data path's one pack
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_OPEN_FIXED = struct.Struct("!BH")  # kind, port
_HEAD_FIXED = struct.Struct("!HB")  # status, reason length
_RESET_FIXED = struct.Struct("!H")  # code

MAX_STREAM_ID = 2**32 - 1
MAX_WINDOW_INCREMENT = 2**31 - 1
MAX_REFUSAL_REASON = 300  # characters of one registration refusal's reason
MAX_ROUTES = 1024  # CIDRs in one ROUTES frame
MAX_RELEASE = 64  # characters of the release a peer announces in HELLO/WELCOME

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_NODE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*\Z")
_BAD_VALUE = re.compile(rb"[\x00\r\n]")
_BAD_REASON = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_RELEASE = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]*\Z")  # a PEP 440 / semver-like string, e.g. 0.2.0 or 1.0.0rc1


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
_FIN_ALLOWED = frozenset({FrameType.OPEN, FrameType.HEAD, FrameType.DATA})


class StreamKind(enum.IntEnum):
    HTTP = 1
    TCP = 2


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


# ---------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    address: str
    pool: str


@dataclass(frozen=True, slots=True)
class Hello:
    """Agent -> gateway, first frame of a session."""

    agent: str
    session: str
    versions: tuple[int, ...] = SUPPORTED_VERSIONS
    window: int = 256 * 1024  # initial per-stream receive window the agent grants
    max_streams: int = 1024  # streams the agent accepts at once
    release: str = ""  # the agent's software release (from 0.2.0 on; empty: not announced, 0.1.0 or older)


@dataclass(frozen=True, slots=True)
class Welcome:
    """Gateway -> agent, answer to HELLO."""

    version: int
    replica: str
    replicas: int
    heartbeat_interval: float
    heartbeat_timeout: float
    window: int = 256 * 1024
    max_streams: int = 1024
    release: str = ""  # the gateway's software release (from 0.2.0 on; empty: not announced)


@dataclass(frozen=True, slots=True)
class Register:
    """Agent -> gateway: the complete set of nodes this session fronts (replaces earlier sets)."""

    nodes: tuple[NodeInfo, ...]


@dataclass(frozen=True, slots=True)
class Registered:
    """Gateway -> agent: which nodes were accepted and which refused, with reasons."""

    accepted: tuple[str, ...]
    refused: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Ping:
    opaque: int


@dataclass(frozen=True, slots=True)
class Pong:
    opaque: int


@dataclass(frozen=True, slots=True)
class Drain:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class GoAway:
    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class Open:
    stream_id: int
    kind: StreamKind
    node: str
    port: int
    method: str = ""
    target: str = ""
    headers: Headers = ()
    fin: bool = False


@dataclass(frozen=True, slots=True)
class Head:
    stream_id: int
    status: int
    reason: str = ""
    headers: Headers = ()
    fin: bool = False


@dataclass(frozen=True, slots=True)
class Data:
    stream_id: int
    data: bytes | memoryview = field(repr=False)
    fin: bool = False


@dataclass(frozen=True, slots=True)
class End:
    stream_id: int


@dataclass(frozen=True, slots=True)
class Reset:
    stream_id: int
    code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Window:
    stream_id: int
    increment: int


@dataclass(frozen=True, slots=True)
class Datagram:
    """One IP packet (layer 3); dropped, never queued without bound, when the session is congested."""

    packet: bytes | memoryview = field(repr=False)


@dataclass(frozen=True, slots=True)
class Routes:
    """Layer 3. Agent -> gateway: the CIDRs this agent announces for its pool (empty: it carries no layer 3).
    Gateway -> agent: the CIDRs reachable through this session, and whether this agent is its pool's active one
    (the one the gateway sends the pool's packets to)."""

    cidrs: tuple[str, ...]
    active: bool = False
    pool: str = ""  # agent -> gateway: the pool the CIDRs belong to (one of its certificate's)


ControlFrame = Hello | Welcome | Register | Registered | Ping | Pong | Drain | GoAway | Datagram | Routes
StreamFrame = Open | Head | Data | End | Reset | Window
Frame = ControlFrame | StreamFrame


# ---------------------------------------------------------------- validation helpers


def valid_node_name(name: str) -> bool:
    """RFC 1123 host name, lower case, at most 253 characters."""
    return 0 < len(name) <= 253 and _NODE_NAME.match(name) is not None


def _check_headers(headers: Headers, stream_id: int) -> None:
    for name, value in headers:
        if not _TOKEN.match(name.encode("latin-1", "replace")):
            raise ProtocolError(f"invalid header name {name[:40]!r}", stream_id)
        if _BAD_VALUE.search(value.encode("latin-1", "replace")):
            raise ProtocolError(f"invalid value for header {name[:40]!r}", stream_id)


# ---------------------------------------------------------------- encoding


def _header(ftype: FrameType, flags: int, stream_id: int) -> bytes:
    return HEADER.pack(ftype, flags, stream_id)


def _encode_headers(headers: Headers) -> bytes:
    parts = [_U16.pack(len(headers))]
    for name, value in headers:
        n = name.encode("latin-1")
        v = value.encode("latin-1")
        parts.append(_U16.pack(len(n)))
        parts.append(n)
        parts.append(_U16.pack(len(v)))
        parts.append(v)
    return b"".join(parts)


def _short_str(text: str, what: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"{what} longer than 255 bytes")
    return bytes((len(raw),)) + raw


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def encode_data(stream_id: int, data: bytes | memoryview, fin: bool = False) -> bytes:
    """The data path's encoder: one concatenation, no other copy."""
    return HEADER.pack(FrameType.DATA, FLAG_FIN if fin else 0, stream_id) + data


def data_header(stream_id: int, length: int, fin: bool, batched: bool) -> bytes:
    """The bytes that precede ``length`` bytes of DATA: the frame header, length-prefixed when batched."""
    flags = FLAG_FIN if fin else 0
    if batched:
        return _BATCHED_HEADER.pack(HEADER_SIZE + length, FrameType.DATA, flags, stream_id)
    return HEADER.pack(FrameType.DATA, flags, stream_id)


def datagram_header(length: int) -> bytes:
    """Length prefix and frame header of a DATAGRAM of ``length`` bytes (version 2)."""
    return _BATCHED_HEADER.pack(HEADER_SIZE + length, FrameType.DATAGRAM, 0, 0)


def length_prefix(frame_size: int) -> bytes:
    return _U32.pack(frame_size)


def split_batch(message: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> list[memoryview]:
    """A version-2 message's frames, as views into it (no copy). A bad length prefix is a session error."""
    view = memoryview(message)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    total = len(view)
    if total > limits.max_frame:
        raise ProtocolError(f"message of {total} bytes exceeds the {limits.max_frame}-byte limit")
    out: list[memoryview] = []
    pos = 0
    while pos < total:
        if total - pos < 4:
            raise ProtocolError(f"truncated length prefix at byte {pos} of a {total}-byte message")
        (size,) = _U32.unpack_from(view, pos)
        pos += 4
        if size < HEADER_SIZE or size > total - pos:
            raise ProtocolError(f"frame length {size} at byte {pos - 4} does not fit the {total}-byte message")
        out.append(view[pos : pos + size])
        pos += size
    if not out:
        raise ProtocolError("empty message")
    return out


def encode(frame: Frame) -> bytes:
    """Serialise one frame to the bytes of one WebSocket message."""
    if isinstance(frame, Data):
        return encode_data(frame.stream_id, frame.data, frame.fin)
    if isinstance(frame, Window):
        if not 0 < frame.increment <= MAX_WINDOW_INCREMENT:
            raise ValueError("window increment out of range")
        return _header(FrameType.WINDOW, 0, frame.stream_id) + _U32.pack(frame.increment)
    if isinstance(frame, End):
        return _header(FrameType.END, 0, frame.stream_id)
    if isinstance(frame, Open):
        if frame.kind == StreamKind.HTTP:
            _check_headers(frame.headers, frame.stream_id)
        target = frame.target.encode("latin-1")
        if len(target) > 0xFFFF:
            raise ValueError("request target longer than 65535 bytes")
        body = b"".join(
            (
                _OPEN_FIXED.pack(frame.kind, frame.port),
                _short_str(frame.node, "node name"),
                _short_str(frame.method, "method"),
                _U16.pack(len(target)),
                target,
                _encode_headers(frame.headers),
            )
        )
        return _header(FrameType.OPEN, FLAG_FIN if frame.fin else 0, frame.stream_id) + body
    if isinstance(frame, Head):
        _check_headers(frame.headers, frame.stream_id)
        reason = _BAD_REASON.sub(b" ", frame.reason.encode("latin-1", "replace")[:255])
        body = _HEAD_FIXED.pack(frame.status, len(reason)) + reason + _encode_headers(frame.headers)
        return _header(FrameType.HEAD, FLAG_FIN if frame.fin else 0, frame.stream_id) + body
    if isinstance(frame, Reset):
        reason = frame.reason.encode("utf-8")[: DEFAULT_LIMITS.max_reason]
        return _header(FrameType.RESET, 0, frame.stream_id) + _RESET_FIXED.pack(frame.code) + reason
    if isinstance(frame, Ping):
        return _header(FrameType.PING, 0, 0) + _U64.pack(frame.opaque)
    if isinstance(frame, Pong):
        return _header(FrameType.PONG, 0, 0) + _U64.pack(frame.opaque)
    if isinstance(frame, Hello):
        return _header(FrameType.HELLO, 0, 0) + _json(
            {
                "agent": frame.agent,
                "session": frame.session,
                "versions": list(frame.versions),
                "window": frame.window,
                "max_streams": frame.max_streams,
                **_release_field(frame.release),
            }
        )
    if isinstance(frame, Welcome):
        return _header(FrameType.WELCOME, 0, 0) + _json(
            {
                "version": frame.version,
                "replica": frame.replica,
                "replicas": frame.replicas,
                "heartbeat_interval": frame.heartbeat_interval,
                "heartbeat_timeout": frame.heartbeat_timeout,
                "window": frame.window,
                "max_streams": frame.max_streams,
                **_release_field(frame.release),
            }
        )
    if isinstance(frame, Register):
        return _header(FrameType.REGISTER, 0, 0) + _json(
            {"nodes": [[n.name, n.address, n.pool] for n in frame.nodes]}
        )
    if isinstance(frame, Registered):
        return _header(FrameType.REGISTERED, 0, 0) + _json(
            {"accepted": list(frame.accepted), "refused": [list(r) for r in frame.refused]}
        )
    if isinstance(frame, Drain):
        return _header(FrameType.DRAIN, 0, 0) + frame.reason.encode("utf-8")[: DEFAULT_LIMITS.max_reason]
    if isinstance(frame, Datagram):
        return _header(FrameType.DATAGRAM, 0, 0) + frame.packet
    if isinstance(frame, Routes):
        return _header(FrameType.ROUTES, 0, 0) + _json({"cidrs": list(frame.cidrs), "active": frame.active,
                                                          "pool": frame.pool})
    if isinstance(frame, GoAway):
        reason = frame.reason.encode("utf-8")[: DEFAULT_LIMITS.max_reason]
        return _header(FrameType.GOAWAY, 0, 0) + _RESET_FIXED.pack(frame.code) + reason
    raise TypeError(f"not a frame: {type(frame).__name__}")


# ---------------------------------------------------------------- decoding


class _Reader:
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
        return int(_U16.unpack(self.take(2, what))[0])

    def text(self, n: int, what: str, encoding: str = "latin-1") -> str:
        raw = self.take(n, what)
        try:
            return bytes(raw).decode(encoding)
        except UnicodeDecodeError:
            raise ProtocolError(f"{what} is not valid {encoding}", self.stream_id) from None

    def done(self, what: str) -> None:
        if self.pos != len(self.buf):
            raise ProtocolError(f"{len(self.buf) - self.pos} trailing bytes after {what}", self.stream_id)


def _decode_headers(r: _Reader, limits: Limits) -> Headers:
    start = r.pos
    count = r.u16("header count")
    if count > limits.max_headers:
        raise ProtocolError(f"{count} headers, limit {limits.max_headers}", r.stream_id)
    out: list[tuple[str, str]] = []
    for _ in range(count):
        name_raw = bytes(r.take(r.u16("header name length"), "header name"))
        if not _TOKEN.match(name_raw):
            raise ProtocolError(f"invalid header name {name_raw[:40]!r}", r.stream_id)
        value_raw = bytes(r.take(r.u16("header value length"), "header value"))
        if _BAD_VALUE.search(value_raw):
            raise ProtocolError(f"invalid value for header {name_raw[:40]!r}", r.stream_id)
        out.append((name_raw.decode("latin-1"), value_raw.decode("latin-1")))
        if r.pos - start > limits.max_header_bytes:
            raise ProtocolError(f"header block over {limits.max_header_bytes} bytes", r.stream_id)
    return tuple(out)


def _load_json(payload: memoryview, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(payload))
    except (ValueError, RecursionError):
        raise ProtocolError(f"{what} is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} is not a JSON object")
    return obj


def _field(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, typ) or isinstance(value, bool):
        raise ProtocolError(f"{what}: field {key!r} missing or of the wrong type")
    return value


def _positive(value: int | float, key: str, what: str, upper: float = 2**31 - 1) -> None:
    if not 0 < value <= upper:
        raise ProtocolError(f"{what}: field {key!r} out of range")


def _str_list(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"{what} must be a list of strings")
    return value


def _release_field(release: str) -> dict[str, str]:
    """HELLO's and WELCOME's optional ``release``: sent only when set, so that an unset one encodes as before.
    Releases before 0.2.0 ignore the key (their decoders read the keys they know and no others)."""
    if not release:
        return {}
    if len(release) > MAX_RELEASE or not _RELEASE.match(release):
        raise ValueError(f"release {release[:80]!r} is not a version string of at most {MAX_RELEASE} characters")
    return {"release": release}


def _read_release(obj: dict[str, Any], what: str) -> str:
    release = obj.get("release", "")
    if release == "":
        return ""
    if not isinstance(release, str) or len(release) > MAX_RELEASE or not _RELEASE.match(release):
        raise ProtocolError(f"{what}: field 'release' must be a version string of at most {MAX_RELEASE} characters")
    return release


def _decode_control(ftype: FrameType, payload: memoryview, limits: Limits) -> ControlFrame:
    if ftype in (FrameType.PING, FrameType.PONG):
        if len(payload) != 8:
            raise ProtocolError(f"{ftype.name} payload must be 8 bytes, got {len(payload)}")
        opaque = int(_U64.unpack(payload)[0])
        return Ping(opaque) if ftype == FrameType.PING else Pong(opaque)
    if ftype == FrameType.DRAIN:
        if len(payload) > limits.max_reason:
            raise ProtocolError("DRAIN reason too long")
        return Drain(bytes(payload).decode("utf-8", "replace"))
    if ftype == FrameType.DATAGRAM:
        if not 0 < len(payload) <= limits.max_data:
            raise ProtocolError(f"DATAGRAM of {len(payload)} bytes: must be 1..{limits.max_data}")
        return Datagram(payload)
    if ftype == FrameType.GOAWAY:
        if not 2 <= len(payload) <= 2 + limits.max_reason:
            raise ProtocolError("GOAWAY payload has a bad length")
        return GoAway(int(_RESET_FIXED.unpack(payload[:2])[0]), bytes(payload[2:]).decode("utf-8", "replace"))
    obj = _load_json(payload, ftype.name)
    if ftype == FrameType.HELLO:
        versions = obj.get("versions")
        if (
            not isinstance(versions, list)
            or not versions
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in versions)
        ):
            raise ProtocolError("HELLO: field 'versions' must be a non-empty list of integers")
        window = _field(obj, "window", int, "HELLO")
        max_streams = _field(obj, "max_streams", int, "HELLO")
        _positive(window, "window", "HELLO")
        _positive(max_streams, "max_streams", "HELLO", 1 << 20)
        return Hello(
            agent=_field(obj, "agent", str, "HELLO"),
            session=_field(obj, "session", str, "HELLO"),
            versions=tuple(versions),
            window=window,
            max_streams=max_streams,
            release=_read_release(obj, "HELLO"),
        )
    if ftype == FrameType.WELCOME:
        interval = _field(obj, "heartbeat_interval", (int, float), "WELCOME")
        timeout = _field(obj, "heartbeat_timeout", (int, float), "WELCOME")
        _positive(interval, "heartbeat_interval", "WELCOME", 3600)
        _positive(timeout, "heartbeat_timeout", "WELCOME", 3600)
        replicas = _field(obj, "replicas", int, "WELCOME")
        _positive(replicas, "replicas", "WELCOME", 1 << 16)
        window = _field(obj, "window", int, "WELCOME")
        max_streams = _field(obj, "max_streams", int, "WELCOME")
        _positive(window, "window", "WELCOME")
        _positive(max_streams, "max_streams", "WELCOME", 1 << 20)
        return Welcome(
            version=_field(obj, "version", int, "WELCOME"),
            replica=_field(obj, "replica", str, "WELCOME"),
            replicas=replicas,
            heartbeat_interval=float(interval),
            heartbeat_timeout=float(timeout),
            window=window,
            max_streams=max_streams,
            release=_read_release(obj, "WELCOME"),
        )
    if ftype == FrameType.REGISTER:
        nodes = obj.get("nodes")
        if not isinstance(nodes, list):
            raise ProtocolError("REGISTER: field 'nodes' must be a list")
        out = []
        # Nodes of one registration mostly share their pool (and often an address): one string object each,
        # not one per node, since the gateway keeps the registration for the session's life.
        same: dict[str, str] = {}
        for entry in nodes:
            items = _str_list(entry, "REGISTER: each node")
            if len(items) != 3:
                raise ProtocolError("REGISTER: each node must be [name, address, pool]")
            name, address, pool = items
            out.append(NodeInfo(name, same.setdefault(address, address), same.setdefault(pool, pool)))
        return Register(tuple(out))
    if ftype == FrameType.ROUTES:
        cidrs = _str_list(obj.get("cidrs"), "ROUTES: 'cidrs'")
        if len(cidrs) > MAX_ROUTES or any(len(c) > 64 for c in cidrs):
            raise ProtocolError(f"ROUTES: at most {MAX_ROUTES} CIDRs of at most 64 characters")
        active = obj.get("active", False)
        pool = obj.get("pool", "")
        if not isinstance(active, bool) or not isinstance(pool, str) or len(pool) > 63:
            raise ProtocolError("ROUTES: 'active' must be a boolean and 'pool' a name")
        return Routes(tuple(cidrs), active, pool)
    if ftype == FrameType.REGISTERED:
        accepted = _str_list(obj.get("accepted"), "REGISTERED: 'accepted'")
        refused_raw = obj.get("refused")
        if not isinstance(refused_raw, list):
            raise ProtocolError("REGISTERED: field 'refused' must be a list")
        refused = []
        for entry in refused_raw:
            items = _str_list(entry, "REGISTERED: each refusal")
            if len(items) != 2:
                raise ProtocolError("REGISTERED: each refusal must be [name, reason]")
            refused.append((items[0], items[1]))
        return Registered(tuple(accepted), tuple(refused))
    raise ProtocolError(f"unhandled control frame {ftype.name}")  # pragma: no cover


def split_registered(
    accepted: Sequence[str], refused: Sequence[tuple[str, str]], budget: int = 128 * 1024
) -> list[Registered]:
    """One registration's answer as REGISTERED frames of at most ``budget`` bytes each.

    Every agent accepts frames of 256 KiB at least (``max_frame`` has that floor), so the default budget
    fits any agent. Refusal reasons are cut to ``MAX_REFUSAL_REASON`` characters. The agent adds the
    frames up (each carries part of the answer). Refused names are cut to 253 characters.
    """
    out: list[Registered] = []
    acc: list[str] = []
    ref: list[tuple[str, str]] = []
    size = 64  # the frame header and the JSON skeleton
    items: list[tuple[str, str | tuple[str, str]]] = [("a", name) for name in accepted]
    # A refused name is echoed cut to 253 characters (a valid name never is): a peer's 1 MiB name must not
    # come back as a frame larger than any agent accepts.
    items += [("r", (name[:253], reason[:MAX_REFUSAL_REASON])) for name, reason in refused]
    for kind, item in items:
        cost = len(json.dumps(item)) + 2
        if (acc or ref) and size + cost > budget:
            out.append(Registered(tuple(acc), tuple(ref)))
            acc, ref, size = [], [], 64
        if kind == "a":
            acc.append(item)  # type: ignore[arg-type]
        else:
            ref.append(item)  # type: ignore[arg-type]
        size += cost
    if acc or ref or not out:
        out.append(Registered(tuple(acc), tuple(ref)))
    return out


def decode(message: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """Parse one frame (a version-1 message, or one of split_batch's views of a version-2 message).

    Raises :class:`ProtocolError` (and nothing else) for any malformed input. Its
    ``stream_id`` is non-zero when only that stream is affected.
    """
    view = memoryview(message)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if len(view) < HEADER_SIZE:
        raise ProtocolError(f"frame of {len(view)} bytes is shorter than the {HEADER_SIZE}-byte header")
    if len(view) > limits.max_frame:
        raise ProtocolError(f"frame of {len(view)} bytes exceeds the {limits.max_frame}-byte limit")
    type_byte, flags, stream_id = HEADER.unpack_from(view)
    try:
        ftype = FrameType(type_byte)
    except ValueError:
        raise ProtocolError(f"unknown frame type 0x{type_byte:02x}", stream_id) from None
    payload = view[HEADER_SIZE:]
    if flags & ~FLAG_FIN or (flags and ftype not in _FIN_ALLOWED):
        raise ProtocolError(f"invalid flags 0x{flags:02x} on {ftype.name}", stream_id)
    fin = bool(flags & FLAG_FIN)

    if ftype in CONTROL_TYPES:
        if stream_id != 0:
            raise ProtocolError(f"control frame {ftype.name} on stream {stream_id}")
        return _decode_control(ftype, payload, limits)
    if stream_id == 0:
        raise ProtocolError(f"stream frame {ftype.name} on stream 0")

    if ftype == FrameType.DATA:
        if len(payload) > limits.max_data:
            raise ProtocolError(
                f"DATA of {len(payload)} bytes exceeds {limits.max_data}", stream_id, ResetCode.FLOW_CONTROL
            )
        return Data(stream_id, payload, fin)
    if ftype == FrameType.WINDOW:
        if len(payload) != 4:
            raise ProtocolError("WINDOW payload must be 4 bytes", stream_id)
        inc = int(_U32.unpack(payload)[0])
        if not 0 < inc <= MAX_WINDOW_INCREMENT:
            raise ProtocolError(f"WINDOW increment {inc} out of range", stream_id, ResetCode.FLOW_CONTROL)
        return Window(stream_id, inc)
    if ftype == FrameType.END:
        if payload:
            raise ProtocolError("END carries no payload", stream_id)
        return End(stream_id)
    if ftype == FrameType.RESET:
        if not 2 <= len(payload) <= 2 + limits.max_reason:
            raise ProtocolError("RESET payload has a bad length", stream_id)
        code = int(_RESET_FIXED.unpack(payload[:2])[0])
        return Reset(stream_id, code, bytes(payload[2:]).decode("utf-8", "replace"))
    r = _Reader(payload, stream_id)
    if ftype == FrameType.OPEN:
        kind_byte, port = _OPEN_FIXED.unpack(r.take(_OPEN_FIXED.size, "OPEN"))
        try:
            kind = StreamKind(kind_byte)
        except ValueError:
            raise ProtocolError(f"unknown stream kind {kind_byte}", stream_id) from None
        if port == 0:
            raise ProtocolError("OPEN: port 0", stream_id)
        node = r.text(r.u8("node length"), "node name", "utf-8")
        method = r.text(r.u8("method length"), "method")
        target = r.text(r.u16("target length"), "target")
        headers = _decode_headers(r, limits)
        r.done("OPEN")
        if kind == StreamKind.HTTP and (not _TOKEN.match(method.encode()) or not target):
            raise ProtocolError("OPEN: HTTP stream needs a method token and a target", stream_id)
        return Open(stream_id, kind, node, port, method, target, headers, fin)
    if ftype == FrameType.HEAD:
        status, reason_len = _HEAD_FIXED.unpack(r.take(_HEAD_FIXED.size, "HEAD"))
        if not 100 <= status <= 999:
            raise ProtocolError(f"HEAD: status {status} out of range", stream_id)
        reason = r.text(reason_len, "reason")
        if _BAD_REASON.search(reason.encode("latin-1")):
            raise ProtocolError("HEAD: control character in the reason phrase", stream_id)
        headers = _decode_headers(r, limits)
        r.done("HEAD")
        return Head(stream_id, status, reason, headers, fin)
    raise ProtocolError(f"unhandled frame type {ftype.name}", stream_id)  # pragma: no cover
