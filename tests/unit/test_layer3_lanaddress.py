"""The floating LAN address's pure parts: the ownership label and the gratuitous ARP frame.

Taking, moving and giving up the address on real nodes is tested end to end in tests/e2e/test_layer3.py.
"""

from __future__ import annotations

import ipaddress
import struct

import pytest

from raven.layer3.errors import Layer3Error
from raven.layer3.lanaddress import LABEL_MAX, FloatingAddress, gratuitous_arp, label_for

MAC = bytes.fromhex("02005e0000aa")


def test_the_label_names_the_lan_device_and_the_agent_s_tun_device() -> None:
    assert label_for("eth0", "raven0") == "eth0:raven0"
    assert label_for("eth0", "raven1") != label_for("eth0", "raven0")


def test_a_label_too_long_for_the_kernel_is_shortened_and_still_tells_agents_apart() -> None:
    a, b = label_for("enp0s31f6", "raven-pool-a"), label_for("enp0s31f6", "raven-pool-b")
    assert len(a) <= LABEL_MAX and len(b) <= LABEL_MAX and a != b
    assert a.startswith("enp0s3:") and a == label_for("enp0s31f6", "raven-pool-a")  # stable across restarts


def test_the_gratuitous_arp_request_announces_the_address_at_the_mac_to_everyone() -> None:
    frame = gratuitous_arp(MAC, ipaddress.IPv4Address("10.220.1.100"))
    assert len(frame) == 14 + 28
    assert frame[:6] == b"\xff" * 6 and frame[6:12] == MAC and frame[12:14] == b"\x08\x06"
    htype, ptype, hlen, plen, op, sha, spa, tha, tpa = struct.unpack("!HHBBH6s4s6s4s", frame[14:])
    assert (htype, ptype, hlen, plen, op) == (1, 0x0800, 6, 4, 1)  # Ethernet, IPv4, a request
    assert sha == MAC and tha == b"\x00" * 6
    assert spa == tpa == bytes([10, 220, 1, 100])  # sender and target are the address itself (RFC 5227, 3)


def test_not_an_ethernet_address_is_refused() -> None:
    with pytest.raises(ValueError, match="not an Ethernet address"):
        gratuitous_arp(b"\x01\x02", ipaddress.IPv4Address("10.0.0.1"))


def test_only_ipv4_floating_addresses() -> None:
    with pytest.raises(Layer3Error, match="only IPv4"):
        FloatingAddress("fd00::64/64", None, "raven0")
    lan = FloatingAddress("10.220.1.100/24", None, "raven0")
    assert str(lan) == "10.220.1.100/24" and str(lan.network) == "10.220.1.0/24" and not lan.held
