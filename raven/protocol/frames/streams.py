"""The stream frames (stream id > 0), each with its encoder and its decoder beside it. A decoder gets the frame's
stream id, its payload (a view, never copied here), its FIN flag and the limits; it raises
:class:`ProtocolError` for the stream (or the session) and nothing else."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

from raven.protocol.frames.base import (
    BATCHED_HEADER,
    DEFAULT_LIMITS,
    FLAG_FIELDS,
    FLAG_FIN,
    HEADER,
    HEADER_SIZE,
    MAX_CLIENT_KEY,
    MAX_DEADLINE_MS,
    MAX_WINDOW_INCREMENT,
    TOKEN,
    U16,
    U32,
    FrameType,
    Headers,
    Limits,
    ProtocolError,
    Reader,
    ResetCode,
    StreamKind,
    check_headers,
    decode_headers,
    encode_headers,
    header,
    peer_text,
    short_str,
)

_OPEN_FIXED = struct.Struct("!BH")  # kind, port
_OPEN_FIELDS = struct.Struct("!IBB")  # deadline in ms, hints, client key length (then the key)
HINT_UPLINK_FREE = 0x01  # the pool's uplink is free: the agent sends the node's body as is (no gzip)
_HINTS = HINT_UPLINK_FREE
_CLIENT_KEY = re.compile(rb"[A-Za-z0-9_-]*\Z")
_HEAD_FIXED = struct.Struct("!HB")  # status, reason length
RESET_FIXED = struct.Struct("!H")  # code (RESET and GOAWAY)
_BAD_REASON = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


# ---------------------------------------------------------------- OPEN


@dataclass(frozen=True, slots=True)
class OpenFields:
    """The request's terms, which the gateway states and the agent holds within its own bounds. Fields of OPEN
    from version 3 (:data:`~raven.protocol.frames.base.FIELDS_FROM`); before it they travel as ``x-raven-*``
    headers (raven/protocol/headers.py translates)."""

    deadline_ms: int = 0  # milliseconds left for the request, 0..MAX_DEADLINE_MS; 0: none given (CONNECT)
    client: str = ""  # the fairness key: 0..MAX_CLIENT_KEY characters of [A-Za-z0-9_-]; "": none given
    uplink_free: bool = False  # the pool's uplink is free (pools.<p>.compress false): no gzip before it

    def check(self) -> None:
        """Raise ValueError unless every field is within the wire's bounds."""
        if not 0 <= self.deadline_ms <= MAX_DEADLINE_MS:
            raise ValueError(f"deadline of {self.deadline_ms} ms is outside 0..{MAX_DEADLINE_MS}")
        raw = self.client.encode("ascii", "replace")
        if len(raw) > MAX_CLIENT_KEY or not _CLIENT_KEY.match(raw):
            raise ValueError(f"client key {self.client[:40]!r} is not 0..{MAX_CLIENT_KEY} of [A-Za-z0-9_-]")


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
    fields: OpenFields | None = None  # version 3 on: the request's terms (flag FIELDS); None before it


def encode_open(frame: Open) -> bytes:
    if frame.kind == StreamKind.HTTP:
        check_headers(frame.headers, frame.stream_id)
    target = frame.target.encode("latin-1")
    if len(target) > 0xFFFF:
        raise ValueError("request target longer than 65535 bytes")
    parts = [
        _OPEN_FIXED.pack(frame.kind, frame.port),
        short_str(frame.node, "node name"),
        short_str(frame.method, "method"),
        U16.pack(len(target)),
        target,
        encode_headers(frame.headers),
    ]
    flags = FLAG_FIN if frame.fin else 0
    if frame.fields is not None:
        f = frame.fields
        f.check()
        client = f.client.encode("ascii")
        parts += (_OPEN_FIELDS.pack(f.deadline_ms, HINT_UPLINK_FREE if f.uplink_free else 0, len(client)), client)
        flags |= FLAG_FIELDS
    return header(FrameType.OPEN, flags, frame.stream_id) + b"".join(parts)


def decode_open(stream_id: int, payload: memoryview, flags: int, limits: Limits) -> Open:
    r = Reader(payload, stream_id)
    kind_byte, port = _OPEN_FIXED.unpack(r.take(_OPEN_FIXED.size, "OPEN"))
    try:
        kind = StreamKind(kind_byte)
    except ValueError:
        raise ProtocolError(f"unknown stream kind {kind_byte}", stream_id) from None
    if port == 0 and kind != StreamKind.BACKFILL:  # a backfill stream names no node port
        raise ProtocolError("OPEN: port 0", stream_id)
    node = r.text(r.u8("node length"), "node name", "utf-8")
    method = r.text(r.u8("method length"), "method")
    target = r.text(r.u16("target length"), "target")
    headers = decode_headers(r, limits)
    fields = _decode_fields(r) if flags & FLAG_FIELDS else None
    r.done("OPEN")
    if kind == StreamKind.HTTP and (not TOKEN.match(method.encode()) or not target):
        raise ProtocolError("OPEN: HTTP stream needs a method token and a target", stream_id)
    return Open(stream_id, kind, node, port, method, target, headers, bool(flags & FLAG_FIN), fields)


def _decode_fields(r: Reader) -> OpenFields:
    deadline_ms, hints, client_len = _OPEN_FIELDS.unpack(r.take(_OPEN_FIELDS.size, "OPEN fields"))
    if deadline_ms > MAX_DEADLINE_MS:
        raise ProtocolError(f"OPEN: deadline of {deadline_ms} ms, limit {MAX_DEADLINE_MS}", r.stream_id)
    if hints & ~_HINTS:
        raise ProtocolError(f"OPEN: unknown hints 0x{hints:02x}", r.stream_id)
    if client_len > MAX_CLIENT_KEY:
        raise ProtocolError(f"OPEN: client key of {client_len} bytes, limit {MAX_CLIENT_KEY}", r.stream_id)
    raw = bytes(r.take(client_len, "client key"))
    if not _CLIENT_KEY.match(raw):
        raise ProtocolError("OPEN: client key is not [A-Za-z0-9_-]", r.stream_id)
    return OpenFields(deadline_ms, raw.decode("ascii"), bool(hints & HINT_UPLINK_FREE))


# ---------------------------------------------------------------- HEAD


@dataclass(frozen=True, slots=True)
class Head:
    stream_id: int
    status: int
    reason: str = ""
    headers: Headers = ()
    fin: bool = False


def encode_head(frame: Head) -> bytes:
    check_headers(frame.headers, frame.stream_id)
    reason = _BAD_REASON.sub(b" ", frame.reason.encode("latin-1", "replace")[:255])
    body = _HEAD_FIXED.pack(frame.status, len(reason)) + reason + encode_headers(frame.headers)
    return header(FrameType.HEAD, FLAG_FIN if frame.fin else 0, frame.stream_id) + body


def decode_head(stream_id: int, payload: memoryview, fin: bool, limits: Limits) -> Head:
    r = Reader(payload, stream_id)
    status, reason_len = _HEAD_FIXED.unpack(r.take(_HEAD_FIXED.size, "HEAD"))
    if not 100 <= status <= 999:
        raise ProtocolError(f"HEAD: status {status} out of range", stream_id)
    reason = r.text(reason_len, "reason")
    if _BAD_REASON.search(reason.encode("latin-1")):
        raise ProtocolError("HEAD: control character in the reason phrase", stream_id)
    headers = decode_headers(r, limits)
    r.done("HEAD")
    return Head(stream_id, status, reason, headers, fin)


# ---------------------------------------------------------------- DATA (the data path: one pack, no copy)


@dataclass(frozen=True, slots=True)
class Data:
    stream_id: int
    data: bytes | memoryview = field(repr=False)
    fin: bool = False


def encode_data(stream_id: int, data: bytes | memoryview, fin: bool = False) -> bytes:
    """The data path's encoder: one concatenation, no other copy."""
    return HEADER.pack(FrameType.DATA, FLAG_FIN if fin else 0, stream_id) + data


def data_header(stream_id: int, length: int, fin: bool, batched: bool) -> bytes:
    """The bytes that precede ``length`` bytes of DATA: the frame header, length-prefixed when batched."""
    flags = FLAG_FIN if fin else 0
    if batched:
        return BATCHED_HEADER.pack(HEADER_SIZE + length, FrameType.DATA, flags, stream_id)
    return HEADER.pack(FrameType.DATA, flags, stream_id)


def decode_data(stream_id: int, payload: memoryview, fin: bool, limits: Limits) -> Data:
    if len(payload) > limits.max_data:
        raise ProtocolError(f"DATA of {len(payload)} bytes exceeds {limits.max_data}", stream_id,
                            ResetCode.FLOW_CONTROL)
    return Data(stream_id, payload, fin)


# ---------------------------------------------------------------- END


@dataclass(frozen=True, slots=True)
class End:
    stream_id: int


def encode_end(frame: End) -> bytes:
    return header(FrameType.END, 0, frame.stream_id)


def decode_end(stream_id: int, payload: memoryview, fin: bool, limits: Limits) -> End:
    if payload:
        raise ProtocolError("END carries no payload", stream_id)
    return End(stream_id)


# ---------------------------------------------------------------- RESET


@dataclass(frozen=True, slots=True)
class Reset:
    stream_id: int
    code: int
    reason: str = ""


def encode_reset(frame: Reset) -> bytes:
    reason = frame.reason.encode("utf-8")[: DEFAULT_LIMITS.max_reason]
    return header(FrameType.RESET, 0, frame.stream_id) + RESET_FIXED.pack(frame.code) + reason


def decode_reset(stream_id: int, payload: memoryview, fin: bool, limits: Limits) -> Reset:
    if not 2 <= len(payload) <= 2 + limits.max_reason:
        raise ProtocolError("RESET payload has a bad length", stream_id)
    code = int(RESET_FIXED.unpack(payload[:2])[0])
    return Reset(stream_id, code, peer_text(payload[2:], limits.max_reason))


# ---------------------------------------------------------------- WINDOW


@dataclass(frozen=True, slots=True)
class Window:
    stream_id: int
    increment: int


def encode_window(frame: Window) -> bytes:
    if not 0 < frame.increment <= MAX_WINDOW_INCREMENT:
        raise ValueError("window increment out of range")
    return header(FrameType.WINDOW, 0, frame.stream_id) + U32.pack(frame.increment)


def decode_window(stream_id: int, payload: memoryview, fin: bool, limits: Limits) -> Window:
    if len(payload) != 4:
        raise ProtocolError("WINDOW payload must be 4 bytes", stream_id)
    inc = int(U32.unpack(payload)[0])
    if not 0 < inc <= MAX_WINDOW_INCREMENT:
        raise ProtocolError(f"WINDOW increment {inc} out of range", stream_id, ResetCode.FLOW_CONTROL)
    return Window(stream_id, inc)


StreamFrame = Open | Head | Data | End | Reset | Window
