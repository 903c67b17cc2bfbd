"""What one Raven process installs on its host for layer 3, and removes again: shared by gateway and agent.

The TUN device (read in batches into ``on_packets``), the routes through it in the main table (only ones through
this device: a second agent of a pool on the same node keeps its own), the sysctls: the device's own (loose
rp_filter) kept by this process, forwarding shared with the other Raven processes of the namespace
(:mod:`raven.layer3.sharedsysctls`: set by the first, put back by the last). :meth:`route`
makes the device's routes a wanted set, retrying a change that failed while it is still wanted (at a clean
handover between two agents on one node, the stopping one withdraws its route to the same CIDR a moment after the
other was made active). Packets for the device collect during a loop turn and are written in one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from pyroute2.netlink.exceptions import NetlinkError

from raven.layer3.errors import Layer3Error
from raven.layer3.policy import Drop
from raven.layer3.routes import Route, RouteManager, Sysctls, forwarding_sysctls
from raven.layer3.sharedsysctls import SharedSysctls
from raven.layer3.tun import TunDevice, other_tun_devices

log = logging.getLogger("raven.layer3.host")
MAIN_TABLE = 254
INSTALL_RETRY = 0.1  # seconds before a failed route change is tried again; doubled up to INSTALL_RETRY_MAX
INSTALL_RETRY_MAX = 5.0


class Layer3Host:
    def __init__(self, device: str, addresses: Sequence[str], mtu: int, *, batch: int, manage_sysctls: bool,
                 ipv6: bool, on_drop: Callable[[Drop, int], None],
                 on_write: Callable[[list[memoryview]], None] | None = None) -> None:
        self.name = device
        self.addresses = list(addresses)
        self.mtu = mtu
        self.batch = batch
        self.manage_sysctls = manage_sysctls
        self.ipv6 = ipv6
        self.on_drop = on_drop
        self.on_write = on_write  # told each batch before it is written (metrics)
        self.device: TunDevice | None = None
        self.routes = RouteManager([MAIN_TABLE], devices=[device])  # its own device's routes only
        self.sysctls = Sysctls()  # the device's own settings
        self.shared: SharedSysctls | None = None  # forwarding, shared with the namespace's other Raven processes
        self.wanted: tuple[str, ...] = ()
        self._install_task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # a new wanted set: cuts a retry's backoff short
        self._to_device: list[memoryview] = []
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def open(self, on_packets: Callable[[list[bytes]], None]) -> None:
        """Create the device, set the sysctls, clear stale routes of a crashed run, start reading."""
        self._loop = asyncio.get_running_loop()
        self.device = await TunDevice.open(self.name, addresses=self.addresses, mtu=self.mtu)
        try:
            if self.manage_sysctls:
                wanted = forwarding_sysctls(self.name, self.ipv6)
                own = [(k, v) for k, v in wanted if f".conf.{self.name}." in k]
                self.shared = SharedSysctls(self.sysctls.read, self.sysctls.write)
                self.shared.acquire([kv for kv in wanted if kv not in own])  # logged there
                for key, value in own:
                    self.sysctls.ensure(key, value)  # logged there; restored on exit where Raven changed it
            await self.routes.reconcile([], [])  # a restart after a crash: this device's stale routes go
        except BaseException:
            await self.close()
            raise
        self.device.start(on_packets, self.batch)

    async def close(self) -> None:
        """Stop reading, remove the routes, put the sysctls back (forwarding only if this is the last Raven process
        of the namespace and no other tunnel device still routes through it), remove the device."""
        if self.device is None:
            return
        self.device.stop()
        if self._install_task is not None:
            # A netlink call in flight finishes (shielded, in its thread) before remove_all runs: one at a time.
            self._install_task.cancel()
            with contextlib.suppress(BaseException):
                await self._install_task
            await self.routes.idle()
        changes = await self.routes.remove_all()
        for line in changes.removed:
            log.info("layer3: removed %s", line)
        try:
            others = await other_tun_devices(self.name)
        except (OSError, NetlinkError) as exc:
            log.warning("layer3: cannot list the other tunnel devices (%s): leaving forwarding as it is", exc)
            others = ["?"]
        self.sysctls.restore()  # the device's own; logged there
        if self.shared is not None:
            try:
                self.shared.release(keep=bool(others))  # the last Raven process here puts forwarding back
            except Layer3Error as exc:
                log.warning("layer3: forwarding left as it is: %s", exc)
        await self.device.close()
        self.device = None

    # ------------------------------------------------------------ routes

    def route(self, cidrs: Sequence[str]) -> None:
        """Make the device's routes exactly ``cidrs`` (in the background; retried while still wanted)."""
        wanted = tuple(sorted(cidrs))
        if wanted == self.wanted or self._loop is None or self.device is None:
            self.wanted = wanted
            return
        self.wanted = wanted
        self._changed.set()
        if self._install_task is None or self._install_task.done():
            self._install_task = self._loop.create_task(self._install())

    async def _install(self) -> None:
        delay, attempt = INSTALL_RETRY, 0
        while self.device is not None:
            cidrs = self.wanted
            try:
                changes = await self.routes.reconcile([Route(c, table=MAIN_TABLE, device=self.name) for c in cidrs], [])
            except (OSError, NetlinkError, Layer3Error) as exc:
                log.error("layer3: cannot change the routes of %s (%s): trying again in %.1fs", self.name, exc, delay)
                await self._wait_retry(delay)
                delay = min(delay * 2, INSTALL_RETRY_MAX)
                continue
            for line in changes.added:
                log.info("layer3: installed %s%s", line, f" (attempt {attempt + 1})" if attempt else "")
            for line in changes.removed:
                log.info("layer3: withdrew %s", line)
            for line in changes.failed:
                (log.debug if attempt else log.error)("layer3: could not change route: %s", line)
            if cidrs != self.wanted:
                delay, attempt = INSTALL_RETRY, 0  # wanted something else meanwhile: at once
                continue
            if not changes.failed:
                return
            await self._wait_retry(delay)
            delay, attempt = min(delay * 2, INSTALL_RETRY_MAX), attempt + 1

    async def _wait_retry(self, delay: float) -> None:
        """Back off, unless a new wanted set arrives first (a promotion must not wait for the backoff)."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._changed.wait()

    # ------------------------------------------------------------ packets

    def write(self, packet: memoryview) -> None:
        """Queue a packet for the device; this loop turn's packets are written in one batch."""
        self._to_device.append(packet)  # a view into the received message, alive until the flush
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        packets, self._to_device = self._to_device, []
        if self.device is None or not packets:
            return
        if self.on_write is not None:
            self.on_write(packets)
        drops = self.device.stats.drops
        before = dict(drops)
        self.device.write_batch(packets)
        for reason, n in drops.items():
            if n > before.get(reason, 0):
                self.on_drop(reason, n - before.get(reason, 0))
