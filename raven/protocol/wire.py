"""The Raven tunnel wire format: a pure codec with no I/O.

Version 1: one binary WebSocket message carries exactly one frame. Version 2 (batched): a message carries one
or more frames, each preceded by its length (u32, big-endian), so a sender writes everything it has in one
message per turn of its event loop. Version 3 is version 2 whose OPEN carries the request's terms (deadline,
client key, hints) as fields, flag FIELDS, instead of ``x-raven-*`` headers. The frame header is the same in all::

    +--------+--------+--------------------------------+-----------------+
    | type 8 | flags 8|        stream id 32 (BE)       | payload ...     |
    +--------+--------+--------------------------------+-----------------+

The payload length is the frame's length (the message's in version 1) minus the 6-byte header. Stream 0 carries
control frames; every other id names one stream. ``decode`` turns a message into one
frame object or raises :class:`ProtocolError`; ``encode`` does the reverse. Nothing here
touches a socket, a clock or a task, so the codec is easy to test and fuzz.
See ``docs/protocol.md`` for the full specification.

Each frame's encoder sits beside its decoder in raven/protocol/frames/ (``streams.py``, ``control.py``, and
``base.py`` for what they share); this module is the one the rest of Raven imports: it re-exports their names,
checks what every frame has in common (size, type, flags, stream 0 or not) and dispatches by type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from raven.protocol.frames.base import (
    ALLOWED_FLAGS,
    BATCHED_FROM,
    CONTROL_TYPES,
    DEFAULT_LIMITS,
    FIELDS_FROM,
    FLAG_FIELDS,
    FLAG_FIN,
    HEADER,
    HEADER_SIZE,
    MAX_CLIENT_KEY,
    MAX_DEADLINE_MS,
    MAX_REFUSAL_REASON,
    MAX_RELEASE,
    MAX_ROUTES,
    MAX_SESSION_ID,
    MAX_STREAM_ID,
    MAX_WINDOW_INCREMENT,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    U32,
    FrameType,
    Headers,
    Limits,
    ProtocolError,
    ResetCode,
    StreamKind,
    peer_text,
    valid_node_name,
    valid_pool_name,
    valid_session_id,
)
from raven.protocol.frames.control import (
    ControlFrame,
    Datagram,
    Drain,
    GoAway,
    Hello,
    NodeInfo,
    Ping,
    Pong,
    Register,
    Registered,
    Routes,
    Welcome,
    datagram_header,
    decode_datagram,
    decode_drain,
    decode_goaway,
    decode_hello,
    decode_ping,
    decode_pong,
    decode_register,
    decode_registered,
    decode_routes,
    decode_welcome,
    encode_datagram,
    encode_drain,
    encode_goaway,
    encode_hello,
    encode_ping,
    encode_pong,
    encode_register,
    encode_registered,
    encode_routes,
    encode_welcome,
    split_registered,
)
from raven.protocol.frames.streams import (
    Data,
    End,
    Head,
    Open,
    OpenFields,
    Reset,
    StreamFrame,
    Window,
    data_header,
    decode_data,
    decode_end,
    decode_head,
    decode_open,
    decode_reset,
    decode_window,
    encode_data,
    encode_end,
    encode_head,
    encode_open,
    encode_reset,
    encode_window,
)

__all__ = [
    "BATCHED_FROM", "CONTROL_TYPES", "DEFAULT_LIMITS", "FIELDS_FROM", "FLAG_FIELDS", "FLAG_FIN", "HEADER",
    "HEADER_SIZE", "MAX_CLIENT_KEY", "MAX_DEADLINE_MS", "MAX_REFUSAL_REASON", "MAX_RELEASE", "MAX_ROUTES",
    "MAX_SESSION_ID", "MAX_STREAM_ID", "MAX_WINDOW_INCREMENT", "PROTOCOL_VERSION", "SUPPORTED_VERSIONS",
    "ControlFrame", "Data", "Datagram", "Drain", "End", "Frame", "FrameType", "GoAway", "Head", "Headers", "Hello",
    "Limits", "NodeInfo", "Open", "OpenFields", "Ping", "Pong", "ProtocolError", "Register", "Registered", "Reset",
    "ResetCode", "Routes", "StreamFrame", "StreamKind", "Welcome", "Window", "data_header", "datagram_header",
    "decode", "encode", "encode_data", "length_prefix", "peer_text", "split_batch", "split_registered",
    "valid_node_name", "valid_pool_name", "valid_session_id",
]

Frame = ControlFrame | StreamFrame


def _encode_data_frame(frame: Data) -> bytes:
    return encode_data(frame.stream_id, frame.data, frame.fin)


_ENCODERS: Final[dict[type[Any], Callable[[Any], bytes]]] = {
    Data: _encode_data_frame,
    Window: encode_window,
    End: encode_end,
    Open: encode_open,
    Head: encode_head,
    Reset: encode_reset,
    Ping: encode_ping,
    Pong: encode_pong,
    Hello: encode_hello,
    Welcome: encode_welcome,
    Register: encode_register,
    Registered: encode_registered,
    Drain: encode_drain,
    Datagram: encode_datagram,
    Routes: encode_routes,
    GoAway: encode_goaway,
}

_CONTROL_DECODERS: Final[dict[FrameType, Callable[[memoryview, Limits], ControlFrame]]] = {
    FrameType.HELLO: decode_hello,
    FrameType.WELCOME: decode_welcome,
    FrameType.REGISTER: decode_register,
    FrameType.REGISTERED: decode_registered,
    FrameType.PING: decode_ping,
    FrameType.PONG: decode_pong,
    FrameType.DRAIN: decode_drain,
    FrameType.GOAWAY: decode_goaway,
    FrameType.DATAGRAM: decode_datagram,
    FrameType.ROUTES: decode_routes,
}

_STREAM_DECODERS: Final[dict[FrameType, Callable[[int, memoryview, bool, Limits], StreamFrame]]] = {
    FrameType.DATA: decode_data,
    FrameType.WINDOW: decode_window,
    FrameType.END: decode_end,
    FrameType.RESET: decode_reset,
    FrameType.HEAD: decode_head,
}


def encode(frame: Frame) -> bytes:
    """Serialise one frame to the bytes of one WebSocket message."""
    encoder = _ENCODERS.get(type(frame))
    if encoder is None:
        raise TypeError(f"not a frame: {type(frame).__name__}")
    return encoder(frame)


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
    if flags & ~ALLOWED_FLAGS.get(ftype, 0):
        raise ProtocolError(f"invalid flags 0x{flags:02x} on {ftype.name}", stream_id)
    if ftype in CONTROL_TYPES:
        if stream_id != 0:
            raise ProtocolError(f"control frame {ftype.name} on stream {stream_id}")
        return _CONTROL_DECODERS[ftype](payload, limits)
    if stream_id == 0:
        raise ProtocolError(f"stream frame {ftype.name} on stream 0")
    if ftype is FrameType.OPEN:
        return decode_open(stream_id, payload, flags, limits)  # its flags say whether it carries fields
    return _STREAM_DECODERS[ftype](stream_id, payload, bool(flags & FLAG_FIN), limits)


# ---------------------------------------------------------------- version 2: frames batched in one message


def length_prefix(frame_size: int) -> bytes:
    return U32.pack(frame_size)


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
        (size,) = U32.unpack_from(view, pos)
        pos += 4
        if size < HEADER_SIZE or size > total - pos:
            raise ProtocolError(f"frame length {size} at byte {pos - 4} does not fit the {total}-byte message")
        out.append(view[pos : pos + size])
        pos += size
    if not out:
        raise ProtocolError("empty message")
    return out
