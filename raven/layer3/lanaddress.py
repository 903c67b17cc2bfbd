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

A SIGKILLed agent cannot remove its address: until it restarts (and removes its leftover) its node still holds
the address beside the new holder. The new holder's gratuitous ARP has already moved the neighbours; the leftover
only answers ARP requests of nodes that had no entry. docs/layer3.md says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from raven.layer3.errors import Layer3Error
from raven.layer3.netlink import on_netlink_loop

log = logging.getLogger("raven.layer3.lanaddress")

ETH_P_ARP = 0x0806
ANNOUNCE_AFTER = (0.0, 0.2, 1.0)  # seconds after taking the address: gratuitous ARP, repeated (a frame can be lost)
RETRY = 0.2  # seconds before a failed change is tried again; doubled up to RETRY_MAX
RETRY_MAX = 5.0
EEXIST = 17
EADDRNOTAVAIL = 99
LABEL_MAX = 15  # IFNAMSIZ - 1


def label_for(lan_device: str, owner: str) -> str:
    """The address label that says which agent on the node holds it: ``<lan device>:<tun device>`` if it fits."""
    label = f"{lan_device}:{owner}"
    if len(label) <= LABEL_MAX:
        return label
    return f"{lan_device[:LABEL_MAX - 9]}:{zlib.crc32(owner.encode()):08x}"


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
    """One agent's side of the pool's floating address. :meth:`hold` says whether it should hold it now."""

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
            found = await on_netlink_loop(self._find)
            self.device = found.name
            if found.held_by == label_for(found.name, self.owner):
                await on_netlink_loop(lambda: self._delete(found.index))
                log.info("layer3: removed %s from %s, left there by this agent's previous run", self, found.name)
        except (OSError, NetlinkError) as exc:
            raise Layer3Error(f"layer3.lan_address {self}: cannot read or change this node's addresses: {exc} "
                              "(the agent needs CAP_NET_ADMIN)") from None
        log.info("layer3: floating LAN address %s on %s, held while this agent is its pool's active one",
                 self, found.name)

    def hold(self, wanted: bool) -> None:
        """Hold the address (or not) from now on; applied in the background, retried while still wanted."""
        if self._closed:
            return
        self._wanted = wanted
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._apply(), name=f"lan address {self}")

    async def close(self) -> None:
        """Stop, and give the address up if this agent holds it."""
        self._closed = True
        self._wanted = False
        for task in (self._task, self._announce):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        try:
            await self._release()
        except (OSError, NetlinkError, Layer3Error) as exc:
            log.error("layer3: could not remove %s: %s", self, exc)

    # ------------------------------------------------------------ changes

    async def _apply(self) -> None:
        delay = RETRY
        while not self._closed:
            self._changed.clear()
            wanted = self._wanted
            try:
                if wanted:
                    await self._claim()
                else:
                    await self._release()
            except (OSError, NetlinkError, Layer3Error) as exc:
                log.error("layer3: could not %s %s: %s; trying again in %.1fs",
                          "take" if wanted else "give up", self, exc, delay)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._changed.wait()
                delay = min(delay * 2, RETRY_MAX)
                continue
            delay = RETRY
            if self._wanted == wanted:
                return

    async def _claim(self) -> None:
        found = await on_netlink_loop(self._find)
        mine = label_for(found.name, self.owner)
        if found.held_by != mine:
            if found.held_by is not None:
                await on_netlink_loop(lambda: self._delete(found.index))
                log.info("layer3: %s on %s was held by %s on this node: taking it over", self, found.name,
                         found.held_by)
            await on_netlink_loop(lambda: self._add(found.index, mine))
            log.info("layer3: took %s on %s (this agent carries the pool); announcing it", self, found.name)
        self._set_held(True)
        if self._announce is None or self._announce.done():
            self._announce = asyncio.get_running_loop().create_task(self._announce_all(found.name, found.mac))

    async def _release(self) -> None:
        if self._announce is not None:
            self._announce.cancel()
            self._announce = None
        if self.device is None:
            return
        found = await on_netlink_loop(self._find)
        if found.held_by == label_for(found.name, self.owner):
            await on_netlink_loop(lambda: self._delete(found.index))
            log.info("layer3: gave up %s on %s (this agent no longer carries the pool)", self, found.name)
        self._set_held(False)

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
            try:
                with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ARP)) as s:
                    s.bind((device, 0))
                    s.send(frame)
            except OSError as exc:  # no CAP_NET_RAW, or the device went away: the neighbours find out later
                log.warning("layer3: cannot announce %s on %s (gratuitous ARP): %s; the nodes' neighbour "
                            "entries follow only when they expire", self, device, exc)
                return

    # ------------------------------------------------------------ netlink (on the netlink loop)

    async def _find(self) -> _Found:
        async with AsyncIPRoute() as ipr:
            links = {m["index"]: m for m in [m async for m in await ipr.link("dump")]}
            addrs = [m async for m in await ipr.addr("dump", family=socket.AF_INET)]
        index = None
        if self.wanted_device is not None:
            index = next((i for i, m in links.items() if m.get("ifname") == self.wanted_device), None)
            if index is None:
                raise Layer3Error(f"layer3.lan_device {self.wanted_device!r} does not exist on this node")
        else:
            for m in addrs:
                local = m.get("address")
                if local is None or ipaddress.IPv4Address(local) == self.ip:
                    continue
                if ipaddress.IPv4Address(local) in self.network:
                    index = m["index"]
                    break
            if index is None:
                raise Layer3Error(f"layer3.lan_address {self}: no device of this node has an address in "
                                  f"{self.network} (set layer3.lan_device)")
        held_by = None
        for m in addrs:
            if m["index"] == index and m.get("address") == str(self.ip):
                held_by = m.get("label") or ""
        link = links[index]
        mac = bytes.fromhex((link.get("address") or "").replace(":", ""))
        if len(mac) != 6:
            raise Layer3Error(f"layer3.lan_address {self}: device {link.get('ifname')} has no Ethernet address")
        return _Found(index, str(link.get("ifname")), mac, held_by)

    async def _add(self, index: int, label: str) -> None:
        async with AsyncIPRoute() as ipr:
            try:
                await ipr.addr("add", index=index, address=str(self.ip), prefixlen=self.prefixlen, label=label)
            except NetlinkError as exc:
                if exc.code != EEXIST:
                    raise

    async def _delete(self, index: int) -> None:
        async with AsyncIPRoute() as ipr:
            try:
                await ipr.addr("del", index=index, address=str(self.ip), prefixlen=self.prefixlen)
            except NetlinkError as exc:
                if exc.code != EADDRNOTAVAIL:
                    raise
