"""Routes, Raven's routing table and rule, and the sysctls layer 3 needs: installed, reconciled, removed.

**Marking.** Every route Raven installs carries ``proto 82`` (:data:`~raven.layer3.config.RAVEN_PROTO`,
``rtm_protocol``; ``ip route show proto 82`` lists them). Raven's rule is the one that looks up Raven's
table (default 21057, :data:`~raven.layer3.config.RAVEN_TABLE`). Nothing else on the host is touched: a route
that is not marked is never deleted, even in Raven's table.

**Reconciling.** A :class:`RouteManager` owns Raven's routes in the tables it is given (``raven routes``: Raven's
table; a gateway node: the main table), so that two of them never undo each other's work.
:meth:`RouteManager.reconcile` is given the complete wanted state (routes and rules); it reads
what the kernel has, deletes Raven's routes and rules that are not wanted (stale ones from a crash, or from an
older configuration, and duplicates), and adds what is missing. Run at start, a restart after a crash leaves
exactly one of each; run again later, it repairs what someone deleted. :meth:`RouteManager.remove_all` is a
reconcile towards nothing (clean exit). :attr:`RouteManager.installed` is the record of what is in place.

**Sysctls.** :class:`Sysctls` sets a value only where it differs, remembers the value it found, and on
:meth:`Sysctls.restore` puts that back, unless someone else changed it meanwhile (then it is left alone and
logged). :func:`forwarding_sysctls` lists what a gateway node needs.

Every pyroute2 socket is opened in an ``async with`` and so closed on every path.

What is here: the wanted state, the reconcile of routes and of rules toward it, and the sysctls they need.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from raven.layer3 import netns as _netns
from raven.layer3.config import RAVEN_PROTO, RAVEN_RULE_PRIORITY, RAVEN_TABLE
from raven.layer3.errors import Layer3Error
from raven.layer3.netlink import on_netlink_loop

log = logging.getLogger("raven.layer3.routes")

MAIN_TABLE = 254
FAMILIES: tuple[int, ...] = (int(socket.AF_INET), int(socket.AF_INET6))


def _family(cidr: str) -> int:
    return socket.AF_INET6 if ipaddress.ip_network(cidr).version == 6 else socket.AF_INET


def _ipv(family: int) -> str:
    return "IPv6" if family == socket.AF_INET6 else "IPv4"


@dataclass(frozen=True, order=True)
class Route:
    """One wanted route: to ``dst`` (a CIDR) via ``gateway`` and/or out of ``device``, in ``table``."""

    dst: str
    table: int = MAIN_TABLE
    gateway: str | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst", str(ipaddress.ip_network(self.dst, strict=True)))
        if self.gateway is None and self.device is None:
            raise ValueError(f"route to {self.dst}: needs a gateway or a device")

    @property
    def family(self) -> int:
        return _family(self.dst)

    def describe(self) -> str:
        via = f" via {self.gateway}" if self.gateway else ""
        dev = f" dev {self.device}" if self.device else ""
        table = "" if self.table == MAIN_TABLE else f" table {self.table}"
        return f"route {self.dst}{via}{dev}{table} proto {RAVEN_PROTO}"


@dataclass(frozen=True, order=True)
class Rule:
    """One wanted rule: ``from all lookup <table>`` at ``priority``, for one address family."""

    family: int
    table: int = RAVEN_TABLE
    priority: int = RAVEN_RULE_PRIORITY

    def describe(self) -> str:
        return f"rule {self.priority}: from all lookup {self.table} ({_ipv(self.family)})"


@dataclass
class Changes:
    """What one reconcile did (descriptions as in log lines)."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.failed)


# the identity of a route as the kernel reports it: family, dst/len, table, gateway, oif
_Key = tuple[int, str, int, str | None, int | None]


def _route_key(msg: Any) -> _Key:
    dst = msg.get("dst") or ("::" if msg["family"] == socket.AF_INET6 else "0.0.0.0")
    table = msg.get("table") or msg["table"]
    return (msg["family"], f"{dst}/{msg['dst_len']}", table, msg.get("gateway"), msg.get("oif"))


class RouteManager:
    """Reconciles Raven's routes and rules in one network namespace (None: this process's)."""

    def __init__(self, tables: Iterable[int], *, netns: str | None = None,
                 devices: Iterable[str] | None = None) -> None:
        """Manage Raven's routes in ``tables`` only (e.g. ``{RAVEN_TABLE}`` for ``raven routes``, ``{254}``
        for the device routes of a gateway node): two managers of different tables never undo each other.
        With ``devices``, only Raven's routes out of those devices are this manager's: two agents with their
        own TUN devices in one namespace (a standby beside the active one) never delete each other's routes.
        (A route out of a device that is gone went with it: the kernel deletes a device's routes.)"""
        self.tables = frozenset(tables)
        self.netns = netns
        self.devices = None if devices is None else frozenset(devices)
        self.installed: dict[str, Route | Rule] = {}  # description -> what is in place now
        self._lock: asyncio.Lock | None = None  # one netlink call at a time (each runs in a worker thread)

    async def _serialised(self, fn: Callable[[], Coroutine[Any, Any, Changes]]) -> Changes:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            call = asyncio.ensure_future(on_netlink_loop(fn))
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:
                # The thread cannot be stopped: hold the lock until it is done, so no second call runs beside it.
                with contextlib.suppress(BaseException):
                    await call
                raise

    async def idle(self) -> None:
        """Until no netlink call of this manager is in flight."""
        if self._lock is not None:
            async with self._lock:
                pass

    async def reconcile(self, routes: Iterable[Route], rules: Iterable[Rule]) -> Changes:
        """Make Raven's routes and rules exactly ``routes`` and ``rules``; see the module docstring."""
        routes, rules = list(routes), list(rules)
        return await self._serialised(lambda: self._reconcile(routes, rules))

    async def _reconcile(self, routes: Iterable[Route], rules: Iterable[Rule]) -> Changes:
        changes = Changes()
        wanted_routes = sorted(set(routes))
        wanted_rules = sorted(set(rules))
        tables = {r.table for r in wanted_rules} | {r.table for r in self.installed.values() if isinstance(r, Rule)}
        async with AsyncIPRoute(netns=self.netns) as ipr:
            await self._routes(ipr, wanted_routes, changes)
            await self._rules(ipr, wanted_rules, tables, changes)
        return changes

    async def remove_all(self, rule_tables: Iterable[int] = ()) -> Changes:
        """Delete every route marked as Raven's and every rule looking up Raven's tables (those installed
        by this manager and ``rule_tables``)."""
        rule_tables = list(rule_tables)
        return await self._serialised(lambda: self._remove_all(rule_tables))

    async def _remove_all(self, rule_tables: Iterable[int]) -> Changes:
        changes = Changes()
        tables = set(rule_tables) | {r.table for r in self.installed.values() if isinstance(r, Rule)}
        async with AsyncIPRoute(netns=self.netns) as ipr:
            await self._routes(ipr, [], changes)
            await self._rules(ipr, [], tables, changes)
        return changes

    def record(self) -> list[str]:
        """What is installed now, one line each (for logs and status)."""
        return sorted(self.installed)

    # ---------------------------------------------------------------- routes

    async def _routes(self, ipr: AsyncIPRoute, wanted: Sequence[Route], changes: Changes) -> None:
        index: dict[str, int | None] = {}
        for route in wanted:
            if route.device is not None and route.device not in index:
                found = await ipr.link_lookup(ifname=route.device)
                index[route.device] = found[0] if found else None
        want: dict[_Key, Route] = {}
        for route in wanted:
            if route.table not in self.tables:
                raise Layer3Error(f"{route.describe()}: table {route.table} is not one this manager owns")
            oif = index.get(route.device) if route.device else None
            if route.device is not None and oif is None:
                changes.failed.append(f"{route.describe()}: no device {route.device}")
                self.installed.pop(route.describe(), None)
                continue
            want[(route.family, route.dst, route.table, route.gateway, oif)] = route
        own_oifs: set[int] | None = None
        if self.devices is not None:
            own_oifs = set()
            for name in self.devices:
                own_oifs.update(await ipr.link_lookup(ifname=name))
        have: dict[_Key, Any] = {}
        for family in FAMILIES:
            for msg in [m async for m in await ipr.route("dump", family=family, proto=RAVEN_PROTO)]:
                if msg["proto"] != RAVEN_PROTO or (msg.get("table") or msg["table"]) not in self.tables:
                    continue
                if own_oifs is not None and msg.get("oif") not in own_oifs:
                    continue  # another manager's (another agent's device in this namespace)
                key = _route_key(msg)
                if key not in want and key[3] is not None and (*key[:4], None) in want:
                    key = (*key[:4], None)  # a route via a gateway: the kernel adds the oif it resolved
                if key in have or key not in want:  # stale (a crash, an older configuration) or a duplicate
                    await self._del_route(ipr, _route_key(msg), changes)
                else:
                    have[key] = msg
        for key, route in want.items():
            if key in have:
                self.installed[route.describe()] = route
                continue
            family, dst, table, gateway, oif = key
            spec: dict[str, Any] = {"dst": dst, "table": table, "proto": RAVEN_PROTO, "family": family}
            if gateway:
                spec["gateway"] = gateway
            if oif is not None:
                spec["oif"] = oif
            try:
                await ipr.route("add", **spec)
            except NetlinkError as exc:
                why = ("another route to it is in the way (not Raven's, or another device's)"
                       if exc.code == errno.EEXIST else exc.args[-1])
                changes.failed.append(f"{route.describe()}: {why}")
                self.installed.pop(route.describe(), None)
                continue
            changes.added.append(route.describe())
            self.installed[route.describe()] = route

    async def _del_route(self, ipr: AsyncIPRoute, key: _Key, changes: Changes) -> None:
        family, dst, table, gateway, oif = key
        spec: dict[str, Any] = {"dst": dst, "table": table, "proto": RAVEN_PROTO, "family": family}
        if gateway:
            spec["gateway"] = gateway
        if oif is not None:
            spec["oif"] = oif
        text = f"route {dst}{f' via {gateway}' if gateway else ''}{f' oif {oif}' if oif else ''}" \
               f"{'' if table == MAIN_TABLE else f' table {table}'} proto {RAVEN_PROTO}"
        try:
            await ipr.route("del", **spec)
        except NetlinkError as exc:
            if exc.code not in (errno.ESRCH, errno.ENOENT):  # gone already: fine
                changes.failed.append(f"delete {text}: {exc.args[-1]}")
                return
        changes.removed.append(text)
        for desc, item in list(self.installed.items()):
            if isinstance(item, Route) and item.dst == dst and item.table == table and item.gateway == gateway:
                del self.installed[desc]

    # ---------------------------------------------------------------- rules

    async def _rules(self, ipr: AsyncIPRoute, wanted: Sequence[Rule], tables: set[int], changes: Changes) -> None:
        kept: set[Rule] = set()
        for family in FAMILIES:
            for msg in [m async for m in await ipr.rule("dump", family=family)]:
                table = msg.get("table") or msg["table"]
                if msg["family"] != family or table not in tables:
                    continue
                rule = Rule(family, table, msg.get("priority") or 0)
                if rule in wanted and rule not in kept:
                    kept.add(rule)
                    self.installed[rule.describe()] = rule
                    continue
                try:  # stale (another priority, an old table) or a duplicate
                    await ipr.rule("del", family=family, table=table, priority=rule.priority)
                except NetlinkError as exc:
                    if exc.code not in (errno.ENOENT, errno.ESRCH):
                        changes.failed.append(f"delete {rule.describe()}: {exc.args[-1]}")
                        continue
                changes.removed.append(rule.describe())
                if rule not in wanted:
                    self.installed.pop(rule.describe(), None)
        for rule in wanted:
            if rule in kept:
                continue
            try:
                await ipr.rule("add", family=rule.family, table=rule.table, priority=rule.priority)
            except NetlinkError as exc:
                changes.failed.append(f"{rule.describe()}: {exc.args[-1]}")
                continue
            changes.added.append(rule.describe())
            self.installed[rule.describe()] = rule


def rules_for(cidrs: Iterable[str], table: int = RAVEN_TABLE, priority: int = RAVEN_RULE_PRIORITY) -> list[Rule]:
    """One rule per address family present in ``cidrs``."""
    return sorted({Rule(_family(c), table, priority) for c in cidrs})


# ---------------------------------------------------------------- sysctls


def forwarding_sysctls(device: str, ipv6: bool) -> list[tuple[str, str]]:
    """What a gateway node needs: forwarding on, and loose reverse-path filtering on the TUN device (the
    effective rp_filter is the larger of ``all`` and the device's, so 2 is loose whatever ``all`` says)."""
    wanted = [("net.ipv4.ip_forward", "1"), (f"net.ipv4.conf.{device}.rp_filter", "2")]
    if ipv6:
        wanted.append(("net.ipv6.conf.all.forwarding", "1"))
    return wanted


def _sysctl_path(key: str) -> Path:
    parts = key.split(".")
    if not key or any(p in ("", "..") or "/" in p for p in parts):
        raise Layer3Error(f"{key!r} is not a sysctl name")
    return Path("/proc/sys", *parts)


class Sysctls:
    """Set sysctls where they differ, and put back on :meth:`restore` what was changed (see the module doc)."""

    def __init__(self, *, netns: str | None = None) -> None:
        self.netns = netns
        self.changed: dict[str, tuple[str, str]] = {}  # key -> (value found, value set)

    def read(self, key: str) -> str:
        path = _sysctl_path(key)
        return _netns.call_in(self.netns, lambda: path.read_text().strip())

    def _write(self, key: str, value: str) -> None:
        path = _sysctl_path(key)
        _netns.call_in(self.netns, lambda: path.write_text(value + "\n"))

    def write(self, key: str, value: str) -> None:
        """Set ``key`` (no record kept: for :class:`raven.layer3.sharedsysctls.SharedSysctls`)."""
        self._write(key, value)

    def ensure(self, key: str, value: str) -> bool:
        """Set ``key`` to ``value`` if it differs; True if it was changed."""
        try:
            old = self.read(key)
            if old == value:
                return False
            self._write(key, value)
        except OSError as exc:
            raise Layer3Error(f"cannot set sysctl {key}={value}: {exc.strerror}") from None
        if key not in self.changed:
            self.changed[key] = (old, value)
        else:
            self.changed[key] = (self.changed[key][0], value)
        log.info("layer3: set sysctl %s=%s (was %s)", key, value, old)
        return True

    def restore(self, keep_shared: bool = False) -> list[str]:
        """Put back what :meth:`ensure` changed, newest first; returns what was restored.

        ``keep_shared``: leave the namespace-wide settings (forwarding) as they are, because another tunnel
        device still routes through them; only a device's own settings are put back."""
        restored: list[str] = []
        for key, (old, new) in reversed(list(self.changed.items())):
            if keep_shared and ".conf." not in key:
                log.info("layer3: sysctl %s=%s left on: another tunnel device in this namespace still needs it",
                         key, new)
                continue
            try:
                now = self.read(key)
                if now != new:
                    log.info("layer3: sysctl %s is %s, not the %s Raven set: left alone", key, now, new)
                    continue
                self._write(key, old)
                restored.append(f"{key}={old}")
                log.info("layer3: restored sysctl %s=%s", key, old)
            except FileNotFoundError:
                pass  # a device's setting, gone with the device
            except OSError as exc:
                log.warning("layer3: could not restore sysctl %s=%s: %s", key, old, exc.strerror)
        self.changed.clear()
        return restored
