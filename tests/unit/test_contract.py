"""The HTTP-over-tunnel contract without sockets: OPEN's fields (protocol version 3) encoded and decoded strictly,
the request's terms carried as fields or as x-raven-* headers as the negotiated version says, the one header
filter, and what the agent makes of the terms (within its own bounds)."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.checks import Policy, check_open
from raven.protocol import (
    FIELDS_FROM,
    MAX_CLIENT_KEY,
    MAX_DEADLINE_MS,
    Open,
    OpenFields,
    ProtocolError,
    as_sent,
    check_version,
    filter_headers,
    handshake,
    legacy_headers,
    terms_of,
    wire,
)
from raven.protocol.connection import Connection
from raven.protocol.events import StreamAborted, StreamOpened
from raven.protocol.headers import CLIENT_HEADER, COMPRESS_HEADER, DEADLINE_HEADER

HTTP = wire.StreamKind.HTTP
TERMS = OpenFields(2500, "0123456789abcdef", uplink_free=True)


def http_open(fields: OpenFields | None = TERMS, headers: wire.Headers = (("Host", "edge-1:9400"),),
              sid: int = 1, fin: bool = True) -> Open:
    return Open(sid, HTTP, "edge-1", 9400, "GET", "/metrics", headers, fin, fields)


# ---------------------------------------------------------------- the codec


@pytest.mark.parametrize("frame", [
    http_open(),
    http_open(OpenFields()),  # every term unset
    http_open(OpenFields(MAX_DEADLINE_MS, "a" * MAX_CLIENT_KEY)),  # every bound reached
    http_open(None),  # version 1 and 2: no fields
    http_open(TERMS, (), sid=7, fin=False),
    Open(3, wire.StreamKind.TCP, "edge-1", 10250, fields=OpenFields(client="k_-Z9")),
])
def test_open_round_trips(frame: Open) -> None:
    raw = wire.encode(frame)
    assert bool(raw[1] & wire.FLAG_FIELDS) == (frame.fields is not None)
    assert wire.decode(raw) == frame


def test_the_fields_are_the_payloads_tail() -> None:
    plain = wire.encode(http_open(None))
    with_fields = wire.encode(http_open(OpenFields(2500, "ab", uplink_free=True)))
    assert with_fields[0] == wire.FrameType.OPEN and with_fields[1] == wire.FLAG_FIN | wire.FLAG_FIELDS
    assert with_fields[2:len(plain)] == plain[2:]  # the version-2 payload, unchanged
    # deadline u32 (2500 ms), hints u8 (uplink free), client key length u8, the key
    assert with_fields[len(plain):] == bytes.fromhex("000009c4" "01" "02") + b"ab"


@pytest.mark.parametrize(("fields", "why"), [
    (OpenFields(-1), "deadline"),
    (OpenFields(MAX_DEADLINE_MS + 1), "deadline"),
    (OpenFields(client="a" * (MAX_CLIENT_KEY + 1)), "client key"),
    (OpenFields(client="a b"), "client key"),
    (OpenFields(client="a\r\nX-Evil: 1"), "client key"),
    (OpenFields(client="é"), "client key"),
])
def test_the_encoder_refuses_what_is_out_of_bounds(fields: OpenFields, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        wire.encode(http_open(fields))


def _with_tail(tail: bytes, flags: int = wire.FLAG_FIN | wire.FLAG_FIELDS) -> bytes:
    """A well-formed OPEN's payload without fields, then ``tail`` as its fields, under ``flags``."""
    plain = wire.encode(http_open(None))
    return bytes((plain[0], flags)) + plain[2:] + tail


FIELDS = struct.Struct("!IBB")


@pytest.mark.parametrize(("tail", "why"), [
    (FIELDS.pack(MAX_DEADLINE_MS + 1, 0, 0), "deadline"),
    (FIELDS.pack(2**32 - 1, 0, 0), "deadline"),
    (FIELDS.pack(100, 0x02, 0), "hints"),
    (FIELDS.pack(100, 0x80, 0), "hints"),
    (FIELDS.pack(100, 0, MAX_CLIENT_KEY + 1) + b"a" * (MAX_CLIENT_KEY + 1), "client key of 33"),
    (FIELDS.pack(100, 0, 3) + b"a b", "client key is not"),
    (FIELDS.pack(100, 0, 2) + b"\xc3\xa9", "client key is not"),
    (FIELDS.pack(100, 0, 5) + b"ab", "truncated client key"),
    (FIELDS.pack(100, 0, 0)[:5], "truncated OPEN fields"),
    (b"", "truncated OPEN fields"),
    (FIELDS.pack(100, 0, 1) + b"ab", "trailing bytes"),
])
def test_the_decoder_refuses_bad_fields_for_the_stream(tail: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why) as info:
        wire.decode(_with_tail(tail))
    assert info.value.stream_id == 1  # a stream error (RESET), not the session's end


def test_fields_without_the_flag_are_trailing_bytes_and_the_flag_is_only_opens() -> None:
    with pytest.raises(ProtocolError, match="trailing bytes"):
        wire.decode(_with_tail(FIELDS.pack(100, 0, 0), flags=wire.FLAG_FIN))
    with pytest.raises(ProtocolError, match="invalid flags"):
        wire.decode(_with_tail(FIELDS.pack(100, 0, 0), flags=wire.FLAG_FIELDS | 0x04))
    head = bytearray(wire.encode(wire.Head(1, 200, "OK")))
    head[1] |= wire.FLAG_FIELDS
    with pytest.raises(ProtocolError, match="invalid flags"):
        wire.decode(bytes(head))
    data = bytearray(wire.encode_data(1, b"x"))
    data[1] = wire.FLAG_FIELDS
    with pytest.raises(ProtocolError, match="invalid flags"):
        wire.decode(bytes(data))


_KEY = st.text(alphabet="ABCXYZabcxyz0189_-", max_size=MAX_CLIENT_KEY)


@given(st.integers(0, MAX_DEADLINE_MS), _KEY, st.booleans(), st.booleans())
def test_any_fields_in_bounds_round_trip(deadline_ms: int, client: str, uplink_free: bool, fin: bool) -> None:
    frame = http_open(OpenFields(deadline_ms, client, uplink_free), fin=fin)
    assert wire.decode(wire.encode(frame)) == frame


@settings(max_examples=300)
@given(st.binary(max_size=48), st.integers(0, 255))
def test_any_tail_and_flags_decode_or_raise_protocol_error_only(tail: bytes, flags: int) -> None:
    try:
        frame = wire.decode(_with_tail(tail, flags))
    except ProtocolError:
        return
    assert isinstance(frame, Open)
    if frame.fields is not None:
        frame.fields.check()  # whatever the decoder lets through is within the bounds the encoder keeps
        assert wire.decode(wire.encode(frame)) == frame


# ---------------------------------------------------------------- the terms across versions


def test_as_sent_writes_the_terms_as_the_version_says() -> None:
    frame = http_open(sid=0)
    for version in (1, 2):
        old = as_sent(frame, 5, version)
        assert (old.stream_id, old.fields) == (5, None)
        assert old.headers == (("Host", "edge-1:9400"), (DEADLINE_HEADER, "2500"),
                               (CLIENT_HEADER, "0123456789abcdef"), (COMPRESS_HEADER, "0"))
        received = wire.decode(wire.encode(old))
        assert isinstance(received, Open) and terms_of(received) == TERMS
    new = as_sent(frame, 5, FIELDS_FROM)
    assert (new.stream_id, new.fields, new.headers) == (5, TERMS, (("Host", "edge-1:9400"),))
    # An OPEN given without terms is sent with all of them unset (the agent's own then apply).
    assert as_sent(http_open(None), 1, 3).fields == OpenFields()
    assert as_sent(http_open(None), 1, 2) == http_open(None)


def test_as_sent_keeps_every_other_field_of_the_frame() -> None:
    # as_sent builds the frame field by field (not with dataclasses.replace): a field added to Open must be
    # carried over there too, or this fails.
    frame = Open(0, wire.StreamKind.TCP, "edge-2", 10250, "POST", "/x?y", (("A", "b"),), True, TERMS)
    assert as_sent(frame, 7, FIELDS_FROM) == dataclasses.replace(frame, stream_id=7)
    assert as_sent(frame, 7, 2) == dataclasses.replace(frame, stream_id=7, fields=None,
                                                       headers=(("A", "b"), *legacy_headers(TERMS)))


def test_legacy_headers_name_only_what_is_set() -> None:
    assert legacy_headers(OpenFields()) == ()
    assert legacy_headers(OpenFields(client="k")) == ((CLIENT_HEADER, "k"),)


def test_check_version() -> None:
    check_version(http_open(), 3)
    check_version(http_open(None), 2)
    with pytest.raises(ProtocolError, match="OPEN without fields on a version 3 session"):
        check_version(http_open(None), 3)
    with pytest.raises(ProtocolError, match="OPEN with fields on a version 1 session"):
        check_version(http_open(), 1)


@pytest.mark.parametrize(("headers", "expected"), [
    (((DEADLINE_HEADER, "2500"), (CLIENT_HEADER, "abc"), (COMPRESS_HEADER, "0")), OpenFields(2500, "abc", True)),
    (((DEADLINE_HEADER.upper(), "0"),), OpenFields(1)),  # 0 was "now" before version 3: the shortest deadline
    (((DEADLINE_HEADER, "999999999"),), OpenFields(MAX_DEADLINE_MS)),
    (((DEADLINE_HEADER, "9999999999"),), OpenFields()),  # too long: ignored, as versions 1 and 2 did
    (((DEADLINE_HEADER, "-1"),), OpenFields()),
    (((DEADLINE_HEADER, "１２"),), OpenFields()),  # noqa: RUF001 - digits a bare isdigit() takes
    (((CLIENT_HEADER, "a" * 33),), OpenFields()),
    (((CLIENT_HEADER, "a b"),), OpenFields()),
    (((COMPRESS_HEADER, "1"),), OpenFields()),
    ((("X-Timeout-Ms", "5"), ("Client", "x")), OpenFields()),
])
def test_terms_of_a_version_2_open_read_leniently(headers: wire.Headers, expected: OpenFields) -> None:
    assert terms_of(http_open(None, headers)) == expected


def test_terms_of_a_version_3_open_are_its_fields_whatever_its_headers_say() -> None:
    frame = http_open(OpenFields(100, "k"), ((DEADLINE_HEADER, "60000"), (CLIENT_HEADER, "forged")))
    assert terms_of(frame) == OpenFields(100, "k")


# ---------------------------------------------------------------- negotiated sessions


def negotiated(agent_speaks: tuple[int, ...], gateway_speaks: tuple[int, ...] = wire.SUPPORTED_VERSIONS,
               ) -> tuple[Connection, Connection]:
    """A gateway and an agent connection after a real HELLO/WELCOME exchange (no sockets)."""
    ag = handshake.ClientConnection(wire.Hello("agent-a-1", "s" * 32, agent_speaks))
    gw = handshake.ServerConnection(wire.DEFAULT_LIMITS)
    hello = gw.receive_hello(ag.data_to_send()[0])
    version = handshake.choose_version(hello.versions, gateway_speaks)
    gw.accept(wire.Welcome(version, "gw-0", 1, 5.0, 15.0), 0.0)
    ag.receive_welcome(gw.data_to_send()[0], 0.0, agent_speaks)
    return gw, ag


def opened(gw: Connection, ag: Connection, frame: Open) -> Open:
    gw.open_stream(frame)
    events = [e for m in gw.data_to_send() for e in ag.receive(m, 0.0)]
    (event,) = [e for e in events if isinstance(e, StreamOpened)]
    return event.open


@pytest.mark.parametrize(("agent_speaks", "gateway_speaks", "version"), [
    ((1, 2, 3), (1, 2, 3), 3),  # this release on both sides
    ((1, 2), (1, 2, 3), 2),  # an old agent, a new gateway
    ((1, 2, 3), (1, 2), 2),  # a new agent, an old gateway
    ((1,), (1, 2, 3), 1),
])
def test_the_negotiated_version_decides_how_the_terms_travel(agent_speaks: tuple[int, ...],
                                                             gateway_speaks: tuple[int, ...], version: int) -> None:
    gw, ag = negotiated(agent_speaks, gateway_speaks)
    assert gw.version == ag.version == version
    got = opened(gw, ag, http_open(sid=0))
    assert terms_of(got) == TERMS  # the agent learns the same terms either way
    if version >= FIELDS_FROM:
        assert got.fields == TERMS and not any(n.startswith("x-raven-") for n, _ in got.headers)
    else:
        assert got.fields is None and (DEADLINE_HEADER, "2500") in got.headers


def test_a_version_3_agent_ignores_x_raven_headers_from_its_gateway() -> None:
    gw, ag = negotiated((1, 2, 3))
    forged = ((DEADLINE_HEADER, "1"), (CLIENT_HEADER, "someone-else"), (COMPRESS_HEADER, "0"), ("Accept", "*/*"))
    got = opened(gw, ag, http_open(OpenFields(4000, "mine"), forged, sid=0))
    policy = Policy(frozenset({9400}), frozenset({"GET"}), allow_connect=False, request_timeout=10.0)
    req = check_open(got, "10.0.0.1", policy)
    assert (req.deadline.budget, req.client, req.uplink_free) == (4.0, "mine", False)
    assert req.headers == (("Accept", "*/*"),)  # no x-raven-* ever reaches the node


@pytest.mark.parametrize(("version", "fields"), [(3, None), (2, TERMS), (1, TERMS)])
def test_an_open_written_for_another_version_is_reset(version: int, fields: OpenFields | None) -> None:
    _gw, ag = negotiated(tuple(range(1, version + 1)))
    raw = wire.encode(http_open(fields))
    message = wire.length_prefix(len(raw)) + raw if version >= wire.BATCHED_FROM else raw
    events = ag.receive(message, 0.0)
    assert not any(isinstance(e, StreamOpened) for e in events)
    (reset,) = [wire.decode(m[4:] if version >= wire.BATCHED_FROM else m) for m in ag.data_to_send()]
    assert isinstance(reset, wire.Reset) and reset.code == wire.ResetCode.PROTOCOL
    assert f"version {version} session" in reset.reason
    assert not any(isinstance(e, StreamAborted) for e in events)  # no stream was created
    assert not ag.closed  # the session goes on


# ---------------------------------------------------------------- the one header filter and the agent's bounds


def test_filter_headers_drops_hop_by_hop_named_ravens_own_and_the_callers() -> None:
    pairs = [("Connection", "close, X-Secret"), ("X-Secret", "1"), ("Keep-Alive", "t"), ("TE", "trailers"),
             ("X-Raven-Deadline-Ms", "1"), ("Accept", "*/*"), ("Expect", "100-continue"), ("Upgrade", "h2c")]
    assert filter_headers(pairs, frozenset({"expect"})) == (("Accept", "*/*"),)
    assert filter_headers(pairs) == (("Accept", "*/*"), ("Expect", "100-continue"))
    assert filter_headers([("Authorization", "x"), ("Accept", "a")], frozenset({"authorization"})) == \
        (("Accept", "a"),)


@pytest.mark.parametrize(("deadline_ms", "timeout"), [(0, 10.0), (1, 0.001), (2500, 2.5), (MAX_DEADLINE_MS, 10.0)])
def test_the_agent_holds_the_gateways_deadline_within_its_own(deadline_ms: int, timeout: float) -> None:
    policy = Policy(frozenset({9400}), frozenset({"GET"}), allow_connect=False, request_timeout=10.0)
    req = check_open(http_open(OpenFields(deadline_ms)), "10.0.0.1", policy)
    assert req.deadline.budget == timeout and req.client == "-"
