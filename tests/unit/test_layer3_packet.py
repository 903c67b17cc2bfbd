"""Reading addresses from IP packets: right on well-formed ones, only PacketError on anything else."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raven.layer3.packet import PacketError, addresses, destination, format_address


def ipv4(src: int, dst: int, payload: bytes = b"", ihl: int = 5, total: int | None = None) -> bytes:
    options = b"\0" * (ihl * 4 - 20) if ihl >= 5 else b""
    length = 20 + len(options) + len(payload) if total is None else total
    return struct.pack("!BBHHHBBHII", 0x40 | ihl, 0, length, 0, 0, 64, 6, 0, src, dst) + options + payload


def ipv6(src: int, dst: int, payload: bytes = b"", plen: int | None = None) -> bytes:
    length = len(payload) if plen is None else plen
    return (struct.pack("!IHBB", 0x6 << 28, length, 17, 64) + src.to_bytes(16, "big") + dst.to_bytes(16, "big")
            + payload)


def test_ipv4_and_ipv6_addresses() -> None:
    a, b = int(ipaddress.ip_address("10.1.2.3")), int(ipaddress.ip_address("192.0.2.9"))
    assert addresses(ipv4(a, b, b"x" * 30)) == (4, a, b)
    assert destination(memoryview(ipv4(a, b))) == (4, b)
    c, d = int(ipaddress.ip_address("fd00::1")), int(ipaddress.ip_address("2001:db8::ff"))
    assert addresses(bytearray(ipv6(c, d, b"y" * 8))) == (6, c, d)
    assert format_address(6, d) == "2001:db8::ff" and format_address(4, a) == "10.1.2.3"
    assert addresses(ipv4(a, b, b"z") + b"pad") == (4, a, b)  # trailing bytes tolerated


@pytest.mark.parametrize(("packet", "why"), [
    (b"", "empty"),
    (b"\x45" + b"\0" * 10, "shorter than its 20-byte header"),
    (ipv4(1, 2, ihl=4), "header length 16"),
    (ipv4(1, 2, total=19), "total length 19"),
    (ipv4(1, 2, total=21), "total length 21"),
    (ipv4(1, 2, ihl=15, total=40), "total length 40 does not fit header 60"),
    (ipv4(1, 2, ihl=15)[:40], "does not fit header 60 and buffer 40"),
    (ipv6(1, 2)[:39], "shorter than its 40-byte header"),
    (ipv6(1, 2, b"abc", plen=4), "payload length 4"),
    (b"\x50" + b"\0" * 40, "version 5"),
])
def test_malformed_packets_raise_packet_error(packet: bytes, why: str) -> None:
    with pytest.raises(PacketError, match=why):
        addresses(packet)


@given(st.binary(max_size=120))
def test_hostile_bytes_give_addresses_or_packet_error(data: bytes) -> None:
    for buf in (data, memoryview(data), bytearray(data)):
        try:
            version, src, dst = addresses(buf)
        except PacketError:
            continue
        assert version in (4, 6)
        bits = 32 if version == 4 else 128
        assert 0 <= src < 2**bits and 0 <= dst < 2**bits


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=64), st.integers(5, 15))
def test_any_well_formed_ipv4_header_reads_back(src: int, dst: int, payload: bytes, ihl: int) -> None:
    assert addresses(ipv4(src, dst, payload, ihl=ihl)) == (4, src, dst)


@given(st.integers(0, 2**128 - 1), st.integers(0, 2**128 - 1), st.binary(max_size=64))
def test_any_well_formed_ipv6_header_reads_back(src: int, dst: int, payload: bytes) -> None:
    assert addresses(ipv6(src, dst, payload)) == (6, src, dst)
