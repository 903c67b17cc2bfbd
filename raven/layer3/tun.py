"""The TUN device that carries layer 3: created (or reused) with its addresses and MTU, pumped, removed.

**Creating.** :meth:`TunDevice.open` opens ``/dev/net/tun`` non-blocking and attaches to device ``name``
(default ``raven0``) with ``TUNSETIFF`` (``IFF_TUN | IFF_NO_PI``: bare IP packets, no 4-byte packet-info
header), then with pyroute2 sets its addresses, MTU and state up. The device is *not* persistent: the kernel
removes it (and every route through it) when the last file descriptor closes, so a process that crashes
leaves no device behind.

**Reconciling at start.** A device of the same name may still exist: a persistent TUN made by hand or by an
older version (``ip tuntap add``), or a TAP. A TUN is attached to and reused (made non-persistent, its stale
addresses removed, MTU and addresses set again); a TAP or TUN that cannot be attached with these flags is
deleted and created anew; a device of another kind (veth, bridge...) is not Raven's and is never deleted: that
is an error naming it. A TUN already attached by a live process gives ``EBUSY``: another Raven runs, an error.
There is never a second device.

**Pumping.** :meth:`TunDevice.start` registers the fd with ``loop.add_reader``; each time it is readable, up
to ``batch`` packets are read (until ``EAGAIN``) and handed to the callback as one list: one callback per
loop turn, never an unbounded loop. :meth:`TunDevice.write_batch` writes packets to the device without ever
blocking: a packet larger than the MTU is dropped as ``too-big``, ``EAGAIN`` drops it as ``queue-full``,
another write error drops it as ``malformed`` (the kernel refused the bytes); each drop is counted. IP
semantics: the sender's TCP retransmits.

**Removing.** :meth:`TunDevice.close` stops the pump and closes the fd; if the device is still there
(someone made it persistent meanwhile) it is deleted.

Every pyroute2 socket is opened in an ``async with`` and so closed on every path.

What is here: the TUN ioctls, opening and reconciling the device, the packet pump and its counters.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import ipaddress
import logging
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from raven.layer3 import netns as _netns
from raven.layer3.errors import Layer3Error
from raven.layer3.netlink import on_netlink_loop
from raven.layer3.policy import Drop

log = logging.getLogger("raven.layer3.tun")

DEFAULT_DEVICE = "raven0"
DEFAULT_BATCH = 64
MAX_BATCH = 4096
READ_SIZE = 65535  # the largest IP packet (without jumbograms): a read never truncates, whatever the MTU

TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFA_F_NODAD = 0x02
_IFREQ = struct.Struct("16sH22x")
IFNAMSIZ = 16


def valid_device_name(name: str) -> bool:
    """A Linux interface name: 1-15 bytes, no '/', ':', whitespace, not '.' or '..'."""
    return (
        0 < len(name.encode()) < IFNAMSIZ
        and name not in (".", "..")
        and not any(c in name for c in "/:") and not any(c.isspace() for c in name)
    )


class TunStats:
    """Counters of one device (packets and bytes each way, drops by reason)."""

    __slots__ = ("drops", "read_batches", "rx_bytes", "rx_packets", "tx_bytes", "tx_packets")

    def __init__(self) -> None:
        self.rx_packets = 0  # read from the device (sent by this host's kernel)
        self.rx_bytes = 0
        self.tx_packets = 0  # written to the device (delivered to this host's kernel)
        self.tx_bytes = 0
        self.read_batches = 0
        self.drops: dict[Drop, int] = dict.fromkeys(Drop, 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rx_packets": self.rx_packets, "rx_bytes": self.rx_bytes,
            "tx_packets": self.tx_packets, "tx_bytes": self.tx_bytes,
            "read_batches": self.read_batches,
            "drops": {str(k): v for k, v in self.drops.items()},
        }


def _attach(name: str) -> int:
    """Open /dev/net/tun and attach it to device ``name`` (created if absent); return the fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, _IFREQ.pack(name.encode(), IFF_TUN | IFF_NO_PI))
        # Attached to a device left persistent (by hand or a crash of something else): make it go with us.
        fcntl.ioctl(fd, TUNSETPERSIST, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _interfaces(addresses: Iterable[str]) -> list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]:
    out = []
    for a in addresses:
        try:
            out.append(ipaddress.ip_interface(a))
        except ValueError:
            raise Layer3Error(f"device address {a!r} is not ADDRESS/PREFIX (e.g. 10.77.0.1/24)") from None
    return out


async def _link(ipr: AsyncIPRoute, name: str) -> Any | None:
    try:
        links = [m async for m in await ipr.link("dump", ifname=name)]
    except NetlinkError as exc:
        if exc.code == errno.ENODEV:
            return None
        raise
    return links[0] if links else None


def _kind(link: Any) -> str | None:
    info = link.get("linkinfo")
    return info.get("kind") if info is not None else None


async def other_tun_devices(own: str, netns: str | None = None) -> list[str]:
    """TUN devices in the namespace other than ``own`` (another Raven, e.g. a second agent of the pool on the
    same node, still routing through the shared forwarding settings)."""

    async def dump() -> list[str]:
        async with AsyncIPRoute(netns=netns) as ipr:
            links = [m async for m in await ipr.link("dump")]
        return [str(m.get("ifname")) for m in links if _kind(m) == "tun" and m.get("ifname") != own]

    return await on_netlink_loop(dump)


def _no_link_local(name: str) -> None:
    """No IPv6 link-local address on the device (addr_gen_mode 1, set while it is down): nothing on a routed
    point-to-point tunnel uses one, and without it the kernel sends no router solicitations or MLD reports
    into the tunnel (which the other side could only drop). Nothing to do where IPv6 is off. In a container
    /proc/sys is read-only (podman, Kubernetes without privileged): the device then keeps its link-local
    address, which costs those few dropped packets and nothing else, and that is said once in the log."""
    path = f"/proc/sys/net/ipv6/conf/{name}/addr_gen_mode"
    if os.path.exists(path):
        try:
            with open(path, "w") as f:
                f.write("1\n")
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            log.info("layer3: %s keeps its IPv6 link-local address (%s is read-only here)", name, path)


async def _reconcile_link(ipr: AsyncIPRoute, name: str, want: Sequence[ipaddress.IPv4Interface |
                          ipaddress.IPv6Interface], mtu: int, netns: str | None) -> int:
    """Set MTU, addresses (removing stale ones, IPv6 link-local excepted) and up; return the index."""
    index: int = (await ipr.link_lookup(ifname=name))[0]
    await ipr.link("set", index=index, mtu=mtu)
    _netns.call_in(netns, lambda: _no_link_local(name))
    have = {(a.get("address"), a["prefixlen"]) for a in [m async for m in await ipr.addr("dump", index=index)]}
    wanted = {(str(i.ip), i.network.prefixlen) for i in want}
    for address, prefixlen in sorted(have - wanted, key=str):
        if address is None or ipaddress.ip_address(address).is_link_local:
            continue
        await ipr.addr("del", index=index, address=address, prefixlen=prefixlen)
        log.info("layer3: removed stale address %s/%d from %s", address, prefixlen, name)
    for i in want:
        if (str(i.ip), i.network.prefixlen) not in have:
            # IPv6: no duplicate address detection on a point-to-point device nobody else is on (it would
            # hold the address "tentative", unusable, for a second or more)
            flags = IFA_F_NODAD if i.version == 6 else 0
            await ipr.addr("add", index=index, address=str(i.ip), prefixlen=i.network.prefixlen, flags=flags)
    await ipr.link("set", index=index, state="up")
    return index


class TunDevice:
    """One attached TUN device; see the module docstring. Make it with :meth:`open`."""

    def __init__(self, name: str, fd: int, index: int, mtu: int, netns: str | None, reused: bool) -> None:
        self.name = name
        self.fd = fd
        self.index = index
        self.mtu = mtu
        self.netns = netns
        self.reused = reused
        self.stats = TunStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        name: str = DEFAULT_DEVICE,
        *,
        addresses: Sequence[str] = (),
        mtu: int,
        netns: str | None = None,
    ) -> TunDevice:
        """Create or reuse device ``name`` in ``netns`` (None: this process's namespace), set ``addresses``
        (``ADDRESS/PREFIX``), ``mtu`` and up. Raises :class:`Layer3Error` with the reason."""
        if not valid_device_name(name):
            raise Layer3Error(f"{name!r} is not a valid device name (1-15 characters, no '/', ':' or spaces)")
        if not 68 <= mtu <= 65535:
            raise Layer3Error(f"MTU {mtu} is outside 68..65535")
        want = _interfaces(addresses)
        where = f" in network namespace {netns}" if netns else ""

        async def setup() -> tuple[int, int, bool]:
            async with AsyncIPRoute(netns=netns) as ipr:
                existing = await _link(ipr, name)
                if existing is not None and _kind(existing) != "tun":
                    raise Layer3Error(
                        f"device {name}{where} exists and is a {_kind(existing) or 'device of unknown kind'}, "
                        "not a TUN: Raven does not delete it; remove it or choose another layer3.device"
                    )
                try:
                    fd = _netns.call_in(netns, lambda: _attach(name))
                except OSError as exc:
                    if exc.errno == errno.EBUSY:
                        raise Layer3Error(
                            f"TUN device {name}{where} is in use by another process (is another Raven running?)"
                        ) from None
                    if exc.errno != errno.EINVAL or existing is None:
                        raise Layer3Error(f"cannot create TUN device {name}{where}: {exc.strerror}") from None
                    # A TAP, or a TUN with other flags (multi-queue): left over, not usable: replace it.
                    log.warning("layer3: replacing device %s%s (a TUN/TAP that cannot be attached as IFF_TUN)",
                                name, where)
                    await ipr.link("del", index=existing["index"])
                    existing = None
                    try:
                        fd = _netns.call_in(netns, lambda: _attach(name))
                    except OSError as exc2:
                        raise Layer3Error(f"cannot create TUN device {name}{where}: {exc2.strerror}") from None
                try:
                    index = await _reconcile_link(ipr, name, want, mtu, netns)
                except BaseException as exc:
                    os.close(fd)
                    if isinstance(exc, NetlinkError | OSError):
                        raise Layer3Error(f"cannot set up TUN device {name}{where}: {exc}") from None
                    raise
            return fd, index, existing is not None

        fd, index, reused = await on_netlink_loop(setup)
        device = cls(name, fd, index, mtu, netns, reused=reused)
        log.info(
            "layer3: %s TUN device %s%s (index %d, mtu %d, addresses %s)",
            "reused" if device.reused else "created", name, where, index, mtu,
            ", ".join(str(i) for i in want) or "none",
        )
        return device

    # ---------------------------------------------------------------- packets

    def read_batch(self, limit: int = DEFAULT_BATCH) -> list[bytes]:
        """Read up to ``limit`` packets, stopping early at ``EAGAIN``; never blocks."""
        packets: list[bytes] = []
        read = os.read
        fd = self.fd
        try:
            for _ in range(limit):
                packets.append(read(fd, READ_SIZE))
        except BlockingIOError:
            pass
        if packets:
            stats = self.stats
            stats.rx_packets += len(packets)
            stats.rx_bytes += sum(map(len, packets))
            stats.read_batches += 1
        return packets

    def write_batch(self, packets: Iterable[bytes | bytearray | memoryview]) -> int:
        """Write each packet to the device; drop (and count) what cannot go now. Returns packets written."""
        write = os.write
        fd = self.fd
        mtu = self.mtu
        stats = self.stats
        drops = stats.drops
        sent = 0
        sent_bytes = 0
        for packet in packets:
            size = len(packet)
            if size > mtu:
                drops[Drop.TOO_BIG] += 1
                continue
            try:
                write(fd, packet)
            except BlockingIOError:
                drops[Drop.QUEUE_FULL] += 1
                continue
            except OSError:
                drops[Drop.MALFORMED] += 1  # the kernel refused these bytes (EINVAL) or the device is down (EIO)
                continue
            sent += 1
            sent_bytes += size
        stats.tx_packets += sent
        stats.tx_bytes += sent_bytes
        return sent

    def start(self, callback: Callable[[list[bytes]], None], batch: int = DEFAULT_BATCH) -> None:
        """Call ``callback(packets)`` once per loop turn in which the device had packets (at most ``batch``)."""
        if self._closed:
            raise Layer3Error(f"TUN device {self.name} is closed")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch {batch} is outside 1..{MAX_BATCH}")
        loop = asyncio.get_running_loop()
        self.stop()

        def readable() -> None:
            packets = self.read_batch(batch)
            if packets:
                try:
                    callback(packets)
                except Exception:
                    log.exception("layer3: packet callback of %s failed; %d packets lost", self.name, len(packets))

        loop.add_reader(self.fd, readable)
        self._loop = loop

    def stop(self) -> None:
        """Stop reading (the device stays)."""
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
            self._loop = None

    # ---------------------------------------------------------------- removal

    async def close(self) -> None:
        """Stop, close the fd (the kernel removes the device), and delete the device if it is still there."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        os.close(self.fd)
        async def delete_if_left() -> None:
            async with AsyncIPRoute(netns=self.netns) as ipr:
                left = await ipr.link_lookup(ifname=self.name)
                if left:
                    await ipr.link("del", index=left[0])
                    log.info("layer3: deleted TUN device %s (it had been made persistent)", self.name)

        try:
            await on_netlink_loop(delete_if_left)
        except (NetlinkError, OSError) as exc:
            log.warning("layer3: could not check that TUN device %s is gone: %s", self.name, exc)
            return
        log.info("layer3: removed TUN device %s", self.name)

    async def __aenter__(self) -> TunDevice:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
