"""The codec: round trips, strictness, and fuzzing with arbitrary bytes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raven.protocol import wire

token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)
header_value = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=60)
headers = st.lists(st.tuples(token, header_value), max_size=10).map(tuple)
stream_id = st.integers(min_value=1, max_value=2**32 - 1)
node = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?\Z")
# Free text a peer sends (RESET, GOAWAY, DRAIN reasons) comes back as sent when it has no control character (those
# are escaped at decode: test_peer_text_is_escaped_at_decode).
reason = st.text(alphabet=st.characters(exclude_categories=("Cc", "Cs", "Cf", "Zl", "Zp")), max_size=50)
release = st.one_of(st.just(""), st.from_regex(r"\A[0-9A-Za-z][0-9A-Za-z.+!_-]{0,40}\Z"))

frames = st.one_of(
    st.builds(wire.Data, stream_id, st.binary(max_size=2048), st.booleans()),
    st.builds(wire.Window, stream_id, st.integers(1, wire.MAX_WINDOW_INCREMENT)),
    st.builds(wire.End, stream_id),
    st.builds(wire.Reset, stream_id, st.integers(0, 65535), reason),
    st.builds(
        wire.Open,
        stream_id,
        st.just(wire.StreamKind.HTTP),
        node,
        st.integers(1, 65535),
        st.sampled_from(["GET", "HEAD", "POST"]),
        st.from_regex(r"\A/[a-z0-9/?=&]{0,40}\Z"),
        headers,
        st.booleans(),
    ),
    st.builds(wire.Open, stream_id, st.just(wire.StreamKind.TCP), node, st.integers(1, 65535)),
    st.builds(
        wire.Head, stream_id, st.integers(100, 999), st.text(alphabet="ABCDEFGHIJ ", max_size=20), headers,
        st.booleans(),
    ),
    st.builds(wire.Ping, st.integers(0, 2**64 - 1)),
    st.builds(wire.Pong, st.integers(0, 2**64 - 1)),
    st.builds(wire.Drain, reason),
    st.builds(wire.GoAway, st.integers(0, 65535), reason),
    st.builds(
        wire.Hello, node, token, st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
        st.integers(1, 2**31 - 1), st.integers(1, 1 << 20), release,
    ),
    st.builds(
        wire.Welcome, st.integers(1, 9), token, st.integers(1, 100), st.floats(0.1, 60), st.floats(0.1, 60),
        st.integers(1, 2**31 - 1), st.integers(1, 1 << 20), release,
    ),
    st.builds(wire.Register, st.lists(st.builds(wire.NodeInfo, node, token, token), max_size=5).map(tuple)),
    st.builds(
        wire.Registered, st.lists(node, max_size=5).map(tuple),
        st.lists(st.tuples(node, st.text(max_size=30)), max_size=5).map(tuple),
    ),
)


def _normalise(frame: wire.Frame) -> wire.Frame:
    if isinstance(frame, wire.Data):
        return wire.Data(frame.stream_id, bytes(frame.data), frame.fin)
    return frame


@given(frames)
@settings(max_examples=600)
def test_round_trip(frame: wire.Frame) -> None:
    assert _normalise(wire.decode(wire.encode(frame))) == _normalise(frame)


@given(st.binary(max_size=512))
@settings(max_examples=2000)
def test_arbitrary_bytes_raise_only_protocol_error(data: bytes) -> None:
    try:
        wire.decode(data)
    except wire.ProtocolError as err:
        assert err.reason


@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**32 - 1), st.binary(max_size=300))
@settings(max_examples=2000)
def test_valid_header_arbitrary_payload(ftype: int, flags: int, sid: int, payload: bytes) -> None:
    try:
        wire.decode(wire.HEADER.pack(ftype, flags, sid) + payload)
    except wire.ProtocolError as err:
        assert err.reason


@given(frames, st.data())
@settings(max_examples=500)
def test_mutated_frames_raise_only_protocol_error(frame: wire.Frame, data: st.DataObject) -> None:
    raw = bytearray(wire.encode(frame))
    for _ in range(data.draw(st.integers(1, 4))):
        if len(raw) == 0:
            break
        op = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
        if op == "flip":
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del raw[data.draw(st.integers(0, len(raw) - 1)) :]
        else:
            raw += data.draw(st.binary(min_size=1, max_size=8))
    try:
        wire.decode(bytes(raw))
    except wire.ProtocolError:
        pass


def test_short_and_oversized_frames() -> None:
    with pytest.raises(wire.ProtocolError, match="shorter"):
        wire.decode(b"\x12\x00\x00")
    limits = wire.Limits(max_frame=100)
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        wire.decode(wire.encode_data(1, b"x" * 200), limits)


def test_data_over_limit_is_a_stream_error() -> None:
    with pytest.raises(wire.ProtocolError) as info:
        wire.decode(wire.encode_data(7, b"x" * (wire.DEFAULT_LIMITS.max_data + 1)))
    assert info.value.stream_id == 7
    assert info.value.code == wire.ResetCode.FLOW_CONTROL


def test_unknown_type_and_flags() -> None:
    with pytest.raises(wire.ProtocolError, match="unknown frame type 0x7f"):
        wire.decode(wire.HEADER.pack(0x7F, 0, 3))
    with pytest.raises(wire.ProtocolError, match="invalid flags"):
        wire.decode(wire.HEADER.pack(wire.FrameType.WINDOW, 1, 3) + struct.pack("!I", 1))


def test_control_frames_only_on_stream_zero() -> None:
    raw = bytearray(wire.encode(wire.Ping(1)))
    raw[5] = 9
    with pytest.raises(wire.ProtocolError, match="control frame PING on stream 9"):
        wire.decode(bytes(raw))
    with pytest.raises(wire.ProtocolError, match="on stream 0"):
        wire.decode(wire.encode_data(0, b"x"))


def test_header_injection_rejected() -> None:
    with pytest.raises(wire.ProtocolError, match="invalid value"):
        wire.encode(wire.Head(1, 200, "OK", (("x-a", "evil\r\nx-b: 1"),)))
    with pytest.raises(wire.ProtocolError, match="invalid header name"):
        wire.encode(wire.Head(1, 200, "OK", (("bad name", "v"),)))


def test_window_zero_and_bad_json() -> None:
    with pytest.raises(wire.ProtocolError, match="out of range"):
        wire.decode(wire.HEADER.pack(wire.FrameType.WINDOW, 0, 1) + struct.pack("!I", 0))
    with pytest.raises(wire.ProtocolError, match="not valid JSON"):
        wire.decode(wire.HEADER.pack(wire.FrameType.HELLO, 0, 0) + b"{nope")
    with pytest.raises(wire.ProtocolError, match="'window'"):
        wire.decode(wire.HEADER.pack(wire.FrameType.HELLO, 0, 0) + b'{"agent":"a","session":"s","versions":[1]}')


def test_too_many_headers() -> None:
    frame = wire.Head(1, 200, "OK", tuple((f"h{i}", "v") for i in range(10)))
    with pytest.raises(wire.ProtocolError, match="10 headers, limit 5"):
        wire.decode(wire.encode(frame), wire.Limits(max_headers=5))


def test_node_names() -> None:
    assert wire.valid_node_name("edge-gpu-7")
    assert wire.valid_node_name("edge-gpu-7.example.com")
    assert not wire.valid_node_name("Edge")
    assert not wire.valid_node_name("-edge")
    assert not wire.valid_node_name("a" * 64)
    assert not wire.valid_node_name("")


EVIL = "down\x1b[2J\x1b]0;title\x07\r\nforged row\x00\x9b\u2028\u202eevil"


@pytest.mark.parametrize("frame", [wire.Reset(3, wire.ResetCode.CONNECT_FAILED, EVIL), wire.GoAway(5, EVIL),
                                   wire.Drain(EVIL)], ids=["RESET", "GOAWAY", "DRAIN"])
def test_peer_text_is_escaped_at_decode(frame: wire.Reset | wire.GoAway | wire.Drain) -> None:
    """The free text a peer sends is kept and shown (logs, `raven status`, the status page): it comes out of the
    decoder with every control character a visible escape, so nothing downstream holds it raw."""
    decoded = wire.decode(wire.encode(frame))
    assert isinstance(decoded, wire.Reset | wire.GoAway | wire.Drain) and type(decoded) is type(frame)
    assert decoded.reason == ("down\\x1b[2J\\x1b]0;title\\x07\\r\\nforged row\\x00\\x9b\\u2028\\u202eevil")
    # Escaping grows the text (one byte, four characters): it is still cut to the limit.
    long = wire.decode(wire.encode(wire.Drain("\x01" * wire.DEFAULT_LIMITS.max_reason)))
    assert isinstance(long, wire.Drain) and long.reason == "\\x01" * (wire.DEFAULT_LIMITS.max_reason // 4)


def _hello(agent: str, session: str) -> bytes:
    return wire.encode(wire.Hello(agent, session))


@pytest.mark.parametrize(("agent", "session", "says"), [
    ("edge-agent-1", "\n\x1b[31mX\x07", "field 'session'"),
    ("edge-agent-1", "", "field 'session'"),
    ("edge-agent-1", "a" * (wire.MAX_SESSION_ID + 1), "field 'session'"),
    ("edge-agent-1", "3f2a 9c0e", "field 'session'"),
    ("evil\r\nX-Injected: yes", "3f2a9c0e", "field 'agent'"),
    ("Edge_Agent", "3f2a9c0e", "field 'agent'"),
    ("", "3f2a9c0e", "field 'agent'"),
])
def test_hello_takes_only_a_name_and_a_token(agent: str, session: str, says: str) -> None:
    """HELLO's agent and session id are kept for the session's life and shown: an agent name by the rule node
    names follow, a session id of 1..64 characters of [A-Za-z0-9_-]; anything else is a protocol error."""
    with pytest.raises(wire.ProtocolError, match=says):
        wire.decode(_hello(agent, session))


def test_hello_takes_what_agents_send() -> None:
    for session in ("3f2a9c0e5b7d4e1f8a6c2b9d0e4f7a13", "a" * wire.MAX_SESSION_ID, "x", "A-b_9"):
        hello = wire.decode(_hello("edge-agent-1.pool-a", session))
        assert isinstance(hello, wire.Hello) and hello.session == session
    assert wire.valid_pool_name("pool-a") and not wire.valid_pool_name("pool.a")
    assert not wire.valid_pool_name("pool-a\r\n")
