"""The pool's floating LAN address: held by the node of the pool's active agent, announced by gratuitous ARP.

``raven routes --gateway ADDRESS`` on a pool's other nodes sends the remote CIDRs to one next hop. With several
agents of a pool on different gateway nodes, that next hop must follow the active agent (a SIGKILL, a drained
node, a lost uplink all move it). The agents of the pool share one address on the nodes' network
(``layer3.lan_address``): the active one adds it to its node's LAN device and sends gratuitous ARP requests, so
that every node's neighbour entry for it points at the new node at once; an agent that stops being active (or
exits) removes it again.

Ownership is written on the address itself: its label is ``<lan device>:<tun device>`` (each agent on a node has a
TUN device of its own). At start an agent removes the address only if it carries its own label (a leftover of its
crashed predecessor), never one that another agent on the node holds; an agent taking over from another on the
same node replaces that one's address with its own.

Every change is atomic in the kernel: an address is deleted only if it still carries the label read a moment
before (``RTM_DELADDR`` with ``IFA_LABEL``), so an agent giving the address up never deletes the one another agent
on the node has just put in its place; an add that finds the address there already (another agent was faster)
looks again instead of taking it for its own.

A SIGKILLed agent cannot remove its address: until it restarts on that node (and removes its leftover) the node
still holds the address beside the new holder. The new holder announces it at once and again every
``REANNOUNCE`` seconds, so the neighbours keep pointing at it; the leftover only answers ARP requests of nodes
that had no entry. docs/layer3.md says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
import struct
import zlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from raven.layer3.errors import Layer3Error
from raven.layer3.netlink import on_netlink_loop

log = logging.getLogger("raven.layer3.lanaddress")
T = TypeVar("T")

ETH_P_ARP = 0x0806
ANNOUNCE_AFTER = (0.0, 0.2, 1.0)  # seconds after taking the address: gratuitous ARP, repeated (a frame can be lost)
REANNOUNCE = 10.0  # and then every this many seconds while held (a crashed holder's leftover may answer requests)
RETRY = 0.2  # seconds before a failed change is tried again; doubled up to RETRY_MAX
RETRY_MAX = 5.0
NETLINK_TIMEOUT = 5.0  # seconds for one netlink exchange
CLOSE_TIMEOUT = 10.0  # seconds for close() to let a change in flight finish and give the address up
EEXIST = 17
EADDRNOTAVAIL = 99
LABEL_MAX = 15  # IFNAMSIZ - 1


def label_for(lan_device: str, owner: str) -> str:
    """The address label that says which agent on the node holds it: ``<lan device>:<tun device>`` if it fits,
    else ``<lan device>:<hash of the tun device>`` with as many hex digits as fit (at least four)."""
    label = f"{lan_device}:{owner}"
    if len(label) <= LABEL_MAX:
        return label
    digest = f"{zlib.crc32(owner.encode()):08x}"
    room = LABEL_MAX - len(lan_device) - 1
    if room >= 4:
        return f"{lan_device}:{digest[:room]}"
    return f"{lan_device[:LABEL_MAX - 5]}:{digest[:4]}"


def gratuitous_arp(mac: bytes, address: ipaddress.IPv4Address) -> bytes:
    """An Ethernet frame with a gratuitous ARP request: ``address`` is at ``mac``, to everyone (RFC 5227, 3)."""
    if len(mac) != 6:
        raise ValueError(f"not an Ethernet address: {mac.hex(':')}")
    ip = address.packed
    arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, mac, ip, b"\x00" * 6, ip)
    return b"\xff" * 6 + mac + struct.pack("!H", ETH_P_ARP) + arp


@dataclass(frozen=True)
class _Found:
    index: int
    name: str
    mac: bytes
    held_by: str | None  # the label of the floating address on that device, if some agent holds it


class FloatingAddress:
    """One agent's side of the pool's floating address. :meth:`hold` says whether it should hold it now.

    One background task applies the wanted state, one netlink exchange at a time (each on the netlink loop, with a
    deadline); :meth:`close` tells it to give the address up and waits for it, so that no change still in flight
    can put the address back after the agent has gone.
    """

    def __init__(self, address: str, device: str | None, owner: str,
                 on_change: Callable[[bool], None] | None = None) -> None:
        iface = ipaddress.ip_interface(address)
        if iface.version != 4:
            raise Layer3Error(f"layer3.lan_address {address}: only IPv4 is supported")
        self.ip = ipaddress.IPv4Address(iface.ip)
        self.prefixlen = iface.network.prefixlen
        self.network = iface.network
        self.wanted_device = device
        self.owner = owner
        self.on_change = on_change
        self.held = False
        self.device: str | None = None  # the LAN device, once found
        self._wanted = False
        self._task: asyncio.Task[None] | None = None
        self._announce: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._closed = False

    def __str__(self) -> str:
        return f"{self.ip}/{self.prefixlen}"

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Find the LAN device; remove this agent's leftover of a crashed run (never another agent's address)."""
        try:
            found = await self._netlink(self._find)
            self.device = found.name
            mine = label_for(found.name, self.owner)
            if found.held_by == mine:
                await self._netlink(lambda: self._delete(found.index, mine))
                log.info("layer3: removed %s from %s, left there by this agent's previous run", self, found.name)
        except (OSError, NetlinkError, TimeoutError) as exc:
            raise Layer3Error(f"layer3.lan_address {self}: cannot read or change this node's addresses: "
                              f"{exc or 'timed out'} (the agent needs CAP_NET_ADMIN)") from None
        log.info("layer3: floating LAN address %s on %s, held while this agent is its pool's active one",
                 self, found.name)

    def hold(self, wanted: bool) -> None:
        """Hold the address (or not) from now on; applied in the background, retried while still wanted."""
        if self._closed:
            return
        running = self._task is not None and not self._task.done()
        if wanted == self._wanted and (running or wanted == self.held):
            return  # nothing new (a ROUTES frame that changes nothing for this agent)
        self._wanted = wanted
        self._changed.set()
        if not running:
            self._task = asyncio.get_running_loop().create_task(self._apply(), name=f"lan address {self}")

    async def close(self) -> None:
        """Give the address up if this agent holds it, after any change in flight (bounded by CLOSE_TIMEOUT)."""
        self._wanted = False
        self._changed.set()
        self._closed = True  # hold() changes nothing from now on
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                if self._task is not None and not self._task.done():
                    await asyncio.shield(self._task)
                await self._release()
        except (OSError, NetlinkError, Layer3Error, TimeoutError) as exc:
            log.error("layer3: could not give up %s: %s", self, exc or "timed out")
        finally:
            self._stop_announcing()
            if self._task is not None and not self._task.done():
                self._task.cancel()

    # ------------------------------------------------------------ changes

    async def _apply(self) -> None:
        delay = RETRY
        while True:
            self._changed.clear()
            wanted = self._wanted
            try:
                if wanted:
                    await self._claim()
                else:
                    await self._release()
            except (OSError, NetlinkError, Layer3Error, TimeoutError) as exc:
                if self._closed:
                    raise  # close() reports it
                log.error("layer3: could not %s %s: %s; trying again in %.1fs",
                          "take" if wanted else "give up", self, exc or "timed out", delay)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._changed.wait()
                delay = min(delay * 2, RETRY_MAX)
                continue
            delay = RETRY
            if self._wanted == wanted:
                return

    async def _claim(self) -> None:
        for _ in range(3):  # another agent on the node may add or replace it between a look and a change
            found = await self._netlink(self._find)
            mine = label_for(found.name, self.owner)
            if found.held_by == mine:
                break
            if found.held_by is not None:
                theirs = found.held_by
                await self._netlink(functools.partial(self._delete, found.index, theirs))
                log.info("layer3: %s on %s was held by %s on this node: taking it over", self, found.name, theirs)
            if await self._netlink(functools.partial(self._add, found.index, mine)):
                log.info("layer3: took %s on %s (this agent carries the pool); announcing it", self, found.name)
                break
        else:
            raise Layer3Error(f"{self} keeps being taken by another agent on this node")
        self._set_held(True)
        if self._announce is None or self._announce.done():
            self._announce = asyncio.get_running_loop().create_task(self._announce_all(found.name, found.mac))

    async def _release(self) -> None:
        self._stop_announcing()
        if self.device is None:
            return
        found = await self._netlink(self._find)
        mine = label_for(found.name, self.owner)
        if found.held_by == mine and await self._netlink(lambda: self._delete(found.index, mine)):
            log.info("layer3: gave up %s on %s (this agent no longer carries the pool)", self, found.name)
        self._set_held(False)

    def _stop_announcing(self) -> None:
        if self._announce is not None:
            self._announce.cancel()
            self._announce = None

    def _set_held(self, held: bool) -> None:
        if held != self.held:
            self.held = held
            if self.on_change is not None:
                self.on_change(held)

    async def _announce_all(self, device: str, mac: bytes) -> None:
        frame = gratuitous_arp(mac, self.ip)
        waited = 0.0
        for at in ANNOUNCE_AFTER:
            await asyncio.sleep(at - waited)
            waited = at
            if not self._send(device, frame):
                return
        while True:
            await asyncio.sleep(REANNOUNCE)
            if not self._send(device, frame):
                return

    def _send(self, device: str, frame: bytes) -> bool:
        try:
            with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ARP)) as s:
                s.bind((device, 0))
                s.send(frame)
        except OSError as exc:  # no CAP_NET_RAW, or the device went away: the neighbours find out later
            log.warning("layer3: cannot announce %s on %s (gratuitous ARP): %s; the nodes' neighbour "
                        "entries follow only when they expire", self, device, exc)
            return False
        return True

    # ------------------------------------------------------------ netlink (each call on the netlink loop)

    @staticmethod
    async def _netlink(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        async with asyncio.timeout(NETLINK_TIMEOUT):
            return await on_netlink_loop(fn)

    async def _find(self) -> _Found:
        async with AsyncIPRoute() as ipr:
            links = {m["index"]: m for m in [m async for m in await ipr.link("dump")]}
            addrs = [m async for m in await ipr.addr("dump", family=socket.AF_INET)]

        def mac_of(index: int) -> bytes:
            link = links.get(index)
            raw = (link.get("address") if link is not None else None) or ""
            mac = bytes.fromhex(raw.replace(":", "")) if len(raw) == 17 else b""
            return mac if len(mac) == 6 and any(mac) else b""

        index = None
        if self.wanted_device is not None:
            index = next((i for i, m in links.items() if m.get("ifname") == self.wanted_device), None)
            if index is None:
                raise Layer3Error(f"layer3.lan_device {self.wanted_device!r} does not exist on this node")
        else:
            for m in addrs:  # a device with an Ethernet address and an address of its own in the network
                local = m.get("local") or m.get("address")
                if local is None or m.get("prefixlen", 32) >= 31 or not mac_of(m["index"]):
                    continue
                if ipaddress.IPv4Address(local) != self.ip and ipaddress.IPv4Address(local) in self.network:
                    index = m["index"]
                    break
            if index is None:
                raise Layer3Error(f"layer3.lan_address {self}: no Ethernet device of this node has an address in "
                                  f"{self.network} (set layer3.lan_device)")
        mac = mac_of(index)
        name = str(links[index].get("ifname"))
        if not mac:
            raise Layer3Error(f"layer3.lan_address {self}: device {name} has no Ethernet address")
        held_by = None
        for m in addrs:
            if m["index"] == index and (m.get("local") or m.get("address")) == str(self.ip):
                held_by = m.get("label") or name
        return _Found(index, name, mac, held_by)

    async def _add(self, index: int, label: str) -> bool:
        """Add the address with ``label``; False if it is there already (someone was faster: look again)."""
        return await self._change("add", index, label, EEXIST)

    async def _delete(self, index: int, label: str) -> bool:
        """Delete the address if it still carries ``label`` (the kernel checks); False if it did not."""
        return await self._change("del", index, label, EADDRNOTAVAIL)

    async def _change(self, command: str, index: int, label: str, benign: int) -> bool:
        """One RTM_NEWADDR or RTM_DELADDR; False where the kernel answered ``benign`` (nothing to do)."""
        async with AsyncIPRoute() as ipr:
            try:
                await ipr.addr(command, index=index, address=str(self.ip), prefixlen=self.prefixlen, label=label)
            except NetlinkError as exc:
                if exc.code != benign:
                    raise
                return False
        return True
