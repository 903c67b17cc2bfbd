"""The floating LAN address's pure parts: the ownership label and the gratuitous ARP frame.

Taking, moving and giving up the address on real nodes is tested end to end in tests/e2e/test_layer3.py.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from raven.layer3.errors import Layer3Error
from raven.layer3.lanaddress import LABEL_MAX, FloatingAddress, _Found, gratuitous_arp, label_for

MAC = bytes.fromhex("02005e0000aa")
T = TypeVar("T")


def test_the_label_names_the_lan_device_and_the_agent_s_tun_device() -> None:
    assert label_for("eth0", "raven0") == "eth0:raven0"
    assert label_for("eth0", "raven1") != label_for("eth0", "raven0")


def test_a_label_too_long_for_the_kernel_is_shortened_and_still_tells_agents_apart() -> None:
    a, b = label_for("enp0s31f6", "raven-pool-a"), label_for("enp0s31f6", "raven-pool-b")
    assert len(a) <= LABEL_MAX and len(b) <= LABEL_MAX and a != b
    assert a.startswith("enp0s31f6:") and a == label_for("enp0s31f6", "raven-pool-a")  # stable across restarts
    longest = label_for("a-very-long-nic", "raven0")  # a 15-character device name leaves no room: cut, 4 digits
    assert len(longest) == LABEL_MAX and longest.startswith("a-very-lon:")


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


# ---------------------------------------------------------------- hold, give up, close: against a fake kernel

class FakeKernel:
    """The floating address on one device of one node: its label, or None; changed as the kernel would."""

    def __init__(self) -> None:
        self.label: str | None = None


class FakeAgent(FloatingAddress):
    """A FloatingAddress whose netlink calls change a FakeKernel (``add_delay``: an add that takes that long)."""

    def __init__(self, kernel: FakeKernel, owner: str, add_delay: float = 0.0) -> None:
        super().__init__("10.220.1.100/24", None, owner)
        self.kernel = kernel
        self.add_delay = add_delay
        self.sent: list[bytes] = []

    @staticmethod
    async def _netlink(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        # As on the netlink loop's worker thread: a call, once started, runs to its end even if its caller is
        # cancelled.
        return await asyncio.shield(asyncio.ensure_future(fn()))

    async def _find(self) -> _Found:
        await asyncio.sleep(0)
        return _Found(2, "eth0", MAC, self.kernel.label)

    async def _add(self, index: int, label: str) -> bool:
        await asyncio.sleep(self.add_delay)
        if self.kernel.label is not None:
            return False  # EEXIST
        self.kernel.label = label
        return True

    async def _delete(self, index: int, label: str) -> bool:
        await asyncio.sleep(0)
        if self.kernel.label != label:
            return False  # the kernel deletes only an address with this label
        self.kernel.label = None
        return True

    def _send(self, device: str, frame: bytes) -> bool:
        self.sent.append(frame)
        return True

    async def settled(self) -> None:
        if self._task is not None:
            await asyncio.wait_for(asyncio.shield(self._task), 5)


async def test_close_waits_for_a_change_in_flight_and_leaves_no_address() -> None:
    kernel = FakeKernel()
    agent = FakeAgent(kernel, "raven0", add_delay=0.2)
    await agent.start()
    agent.hold(True)
    await asyncio.sleep(0.05)  # the add is in flight
    await agent.close()
    await asyncio.sleep(0.3)  # anything still in flight has ended by now
    assert kernel.label is None and not agent.held


async def test_an_active_agent_holds_and_announces_and_gives_up() -> None:
    kernel = FakeKernel()
    agent = FakeAgent(kernel, "raven0")
    await agent.start()
    agent.hold(True)
    await agent.settled()
    await asyncio.sleep(0.01)
    assert kernel.label == "eth0:raven0" and agent.held
    assert agent.sent == [gratuitous_arp(MAC, ipaddress.IPv4Address("10.220.1.100"))]
    agent.hold(True)  # nothing new: no second change, no second announcement
    assert agent._task is not None and agent._task.done()
    agent.hold(False)
    await agent.settled()
    assert kernel.label is None and not agent.held
    await agent.close()


async def test_a_leftover_of_this_agent_goes_at_start_another_agent_s_stays() -> None:
    kernel = FakeKernel()
    kernel.label = "eth0:raven0"
    await FakeAgent(kernel, "raven1").start()
    assert kernel.label == "eth0:raven0"  # another agent's: left alone
    await FakeAgent(kernel, "raven0").start()
    assert kernel.label is None  # its own predecessor's: removed


async def test_a_handover_on_one_node_never_deletes_the_new_holder_s_address() -> None:
    for _ in range(20):  # the two agents' netlink steps interleave differently from run to run
        kernel = FakeKernel()
        old, new = FakeAgent(kernel, "raven0"), FakeAgent(kernel, "raven1")
        await old.start()
        await new.start()
        old.hold(True)
        await old.settled()
        old.hold(False)
        new.hold(True)
        await asyncio.gather(old.settled(), new.settled())
        assert kernel.label == "eth0:raven1" and new.held and not old.held
        await old.close()
        assert kernel.label == "eth0:raven1"
        await new.close()
        assert kernel.label is None


async def test_an_add_that_finds_another_agent_s_address_looks_again() -> None:
    kernel = FakeKernel()
    agent = FakeAgent(kernel, "raven0", add_delay=0.05)
    await agent.start()
    agent.hold(True)
    await asyncio.sleep(0.01)
    kernel.label = "eth0:raven1"  # another agent on the node, between this one's look and its add
    await agent.settled()
    assert kernel.label == "eth0:raven0" and agent.held  # not taken for its own: looked again, took it over
    await agent.close()
    assert kernel.label is None
