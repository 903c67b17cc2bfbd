"""Reading the addresses of an IP packet: pure, no I/O, no copies.

Every packet that crosses a Raven TUN device is looked at once, to decide whether it may go where it is going.
That look must be cheap and must survive any bytes a peer sends: :func:`addresses` reads the version and the
source and destination addresses straight out of the buffer (``struct.unpack_from`` and ``int.from_bytes`` on a
memoryview slice, no copy of the packet), checks that the lengths the header claims fit the buffer, and returns
them as integers. Anything else raises :class:`PacketError` (a ``ValueError``), nothing else.

What is here: one reader per IP version, the dispatch by version, and the packet's words in log lines.
"""

from __future__ import annotations

import ipaddress
import struct

from raven.errors import RavenError

IPV4 = 4
IPV6 = 6
IPV4_HEADER = 20  # without options
IPV6_HEADER = 40  # fixed header; extension headers follow it and are not needed here

_V4 = struct.Struct("!BxHxxxxxxxxII")  # version/IHL, total length, source, destination
_V6_PAYLOAD_LENGTH = struct.Struct("!H")


class PacketError(RavenError, ValueError):
    """The bytes are not an IP packet this code accepts; the message says why (for debug logs only)."""


def addresses(packet: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """Return ``(version, source, destination)`` of one IPv4 or IPv6 packet, the addresses as integers.

    Checked: the version nibble (4 or 6), the fixed header fits, IPv4's header length (IHL >= 5) and total
    length fit the buffer, IPv6's payload length fits the buffer. Trailing bytes beyond the length the header
    claims are tolerated (the caller may pass a larger buffer). Raises only :class:`PacketError`.
    """
    size = len(packet)
    if size == 0:
        raise PacketError("empty packet")
    version = packet[0] >> 4
    if version == IPV4:
        if size < IPV4_HEADER:
            raise PacketError(f"IPv4 packet of {size} bytes is shorter than its 20-byte header")
        first, total, src, dst = _V4.unpack_from(packet)
        header = (first & 0x0F) * 4
        if header < IPV4_HEADER:
            raise PacketError(f"IPv4 header length {header} is below 20")
        if total < header or total > size:
            raise PacketError(f"IPv4 total length {total} does not fit header {header} and buffer {size}")
        return IPV4, src, dst
    if version == IPV6:
        if size < IPV6_HEADER:
            raise PacketError(f"IPv6 packet of {size} bytes is shorter than its 40-byte header")
        (payload,) = _V6_PAYLOAD_LENGTH.unpack_from(packet, 4)
        if IPV6_HEADER + payload > size:
            raise PacketError(f"IPv6 payload length {payload} does not fit a buffer of {size}")
        view = packet if isinstance(packet, memoryview) else memoryview(packet)
        return IPV6, int.from_bytes(view[8:24], "big"), int.from_bytes(view[24:40], "big")
    raise PacketError(f"IP version {version} is neither 4 nor 6")


def destination(packet: bytes | bytearray | memoryview) -> tuple[int, int]:
    """Return ``(version, destination)``; the same checks as :func:`addresses`."""
    version, _, dst = addresses(packet)
    return version, dst


def format_address(version: int, value: int) -> str:
    """The text form of an address returned by :func:`addresses` (for log lines, not the per-packet path)."""
    if version == IPV4:
        return str(ipaddress.IPv4Address(value))
    return str(ipaddress.IPv6Address(value))
