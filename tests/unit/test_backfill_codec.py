"""The backfill stream's entries (raven/protocol/backfill.py) and the BACKFILL stream kind on the wire."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raven.protocol import backfill as bf
from raven.protocol import wire

nodes = st.from_regex(r"[a-z][a-z0-9-]{0,30}", fullmatch=True)


@given(st.lists(st.one_of(
    st.builds(bf.Key, st.integers(0, 2**64 - 1), nodes, st.binary(max_size=200)),
    st.builds(bf.Scrape, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
              st.integers(0, 65535), nodes, st.binary(max_size=200)),
), max_size=8), st.integers(1, 50))
def test_entries_round_trip_in_any_pieces(entries: list[bf.Entry], piece: int) -> None:
    body = b"".join(bf.encode(e) for e in entries)
    dec = bf.Decoder()
    out: list[bf.Entry] = []
    for at in range(0, len(body), piece):
        out += dec.feed(body[at:at + piece])
    dec.finish()
    assert out == entries


def test_an_entry_over_the_bound_is_refused_before_it_is_buffered() -> None:
    dec = bf.Decoder(max_entry=1000)
    with pytest.raises(bf.BackfillError, match="limit 1000"):
        dec.feed(bytes((bf.SCRAPE,)) + (2000).to_bytes(4, "big"))


def test_a_body_over_its_bound_is_refused() -> None:
    dec = bf.Decoder(max_entry=1000, max_body=3000)
    entry = bf.encode(bf.Scrape(1, 2, 1, 9400, "n1", b"x" * 900))
    dec.feed(entry + entry)
    with pytest.raises(bf.BackfillError, match="over 3000"):
        dec.feed(entry + entry)


@pytest.mark.parametrize("raw", [
    bytes((9,)) + (3).to_bytes(4, "big") + b"abc",  # unknown type
    bytes((bf.SCRAPE,)) + (5).to_bytes(4, "big") + b"short",  # shorter than its fixed part
    bytes((bf.KEY,)) + (12).to_bytes(4, "big") + (1).to_bytes(8, "big") + b"\x05abc",  # node longer than the entry
    bytes((bf.KEY,)) + (11).to_bytes(4, "big") + (1).to_bytes(8, "big") + b"\x02\xff\xfe",  # node not UTF-8
])
def test_malformed_entries_are_errors_never_crashes(raw: bytes) -> None:
    with pytest.raises(bf.BackfillError):
        bf.Decoder().feed(raw)


def test_a_body_cut_inside_an_entry_is_an_error() -> None:
    dec = bf.Decoder()
    dec.feed(bf.encode(bf.Key(1, "n1", b"abc"))[:-1])
    with pytest.raises(bf.BackfillError, match="inside an entry"):
        dec.finish()


def test_ack_target_round_trips_and_refuses_anything_else() -> None:
    assert bf.parse_ack(bf.ack_target(0)) == 0
    assert bf.parse_ack(bf.ack_target(2**64 - 1)) == 2**64 - 1
    for bad in ("/backfill?ack=", "/backfill?ack=-1", "/backfill?ack=1x", "/metrics", f"/backfill?ack={2**64}",
                "/backfill?ack=1&x=2"):
        with pytest.raises(bf.BackfillError):
            bf.parse_ack(bad)


def test_backfill_open_has_no_port_and_other_kinds_still_need_one() -> None:
    frame = wire.Open(3, wire.StreamKind.BACKFILL, "", 0, "", bf.ack_target(7), fin=True)
    assert wire.decode(wire.encode(frame)) == frame
    tcp = wire.encode(wire.Open(3, wire.StreamKind.TCP, "n1", 0))
    with pytest.raises(wire.ProtocolError, match="port 0"):
        wire.decode(tcp)
