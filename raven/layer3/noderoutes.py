"""``raven routes``: on every non-gateway node, send the remote CIDRs to the local gateway node.

Run by a DaemonSet on every node of a pool (and of the cloud). It programs, with pyroute2, in Raven's own
routing table (default 21057) one route per remote CIDR via the gateway node's address, and one rule per
address family, ``from all lookup 21057`` at priority 21057 (before the main table). Every ``interval`` (30 s)
it checks them again and repairs what differs (each check has a deadline, ``timeout``); on SIGTERM or SIGINT it
removes them all and exits 0. At start, the first check deletes whatever a crashed predecessor left that is no
longer wanted, so a restart never duplicates anything. On the gateway node itself (the gateway's address is
one of this node's) it installs nothing and waits: that node's routes belong to the agent or gateway there.

The gateway address may be a pool's floating address (``layer3.lan_address``), which moves to the node of the
pool's active agent. The command listens to the kernel's address notifications (a netlink socket in the
RTMGRP_IPV4_IFADDR and RTMGRP_IPV6_IFADDR groups, read with the event loop's ``add_reader``; a message that holds
the gateway address's bytes is a wake-up, nothing in it is trusted or parsed): when that address comes or goes
on this node, it checks at once, so a node that has just taken the address stops routing through it (its
agent's own routes then apply) and one that has just lost it routes through the new holder, within milliseconds
rather than at the next ``interval``.

The gateway node must be on this node's network (the kernel wants the next hop on a connected route).

Wiring: :func:`add_parser` adds the ``routes`` command to a ``raven`` command line; :func:`run` is the
command; ``python -m raven.layer3.noderoutes`` runs it on its own.

What is here: the command line, the settings it builds, and the reconcile loop.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from raven import logsafe
from raven.errors import ConfigError, RavenError
from raven.layer3.config import RoutesLayer3, parse
from raven.layer3.errors import Layer3Error
from raven.layer3.netlink import on_netlink_loop
from raven.layer3.routes import Changes, Route, RouteManager, rules_for

log = logging.getLogger("raven.layer3.noderoutes")
RTMGRP_IPV4_IFADDR = 0x10  # netlink multicast groups: IPv4 and IPv6 address changes
RTMGRP_IPV6_IFADDR = 0x100
NOTIFY_DRAIN = 64  # notifications read per wake-up at most (the rest wake the loop again)

DESCRIPTION = (
    "Program the routes that send remote CIDRs to the local gateway node: Raven's own routing table "
    "(default 21057) with one route per CIDR via the gateway node, and a rule 'from all lookup 21057'. "
    "Checked again every --interval seconds; removed on SIGTERM/SIGINT. Needs CAP_NET_ADMIN."
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the ``routes`` command to a ``raven`` command line (``func``: run it)."""
    p = subparsers.add_parser("routes", help="route remote CIDRs to the local gateway node (on every node)",
                              description=DESCRIPTION)
    configure_parser(p)
    p.set_defaults(func=command)
    return p


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path,
                   help="YAML file with a 'layer3: routes:' section (the flags below override it)")
    p.add_argument("--gateway", help="address of the local gateway node")
    p.add_argument("--cidr", action="append", dest="cidrs", metavar="CIDR",
                   help="a remote CIDR to route via the gateway node (repeat for more)")
    p.add_argument("--table", type=int, help="Raven's routing table id (default 21057)")
    p.add_argument("--priority", type=int, help="priority of Raven's rule (default 21057)")
    p.add_argument("--interval", type=float, help="seconds between checks (default 30)")
    p.add_argument("--timeout", type=float, help="deadline of one check in seconds (default 10)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def settings(args: argparse.Namespace) -> RoutesLayer3:
    """The validated settings: the file's ``layer3.routes`` section, then the flags."""
    tree: dict[str, Any] = {}
    where = "layer3.routes"
    path: Path | None = getattr(args, "config", None)
    if path is not None:
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
        section = ((data or {}).get("layer3") or {}).get("routes") if isinstance(data, dict) else None
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"{path}: layer3.routes must be a mapping")
        tree.update(section or {})
        where = f"{path}: layer3.routes"
    for name in ("gateway", "cidrs", "table", "priority", "interval", "timeout"):
        value = getattr(args, name, None)
        if value is not None:
            tree[name] = value
    return parse(RoutesLayer3, tree, where)


async def _is_local(address: str) -> bool:
    wanted = ipaddress.ip_address(address)

    async def dump() -> bool:
        async with AsyncIPRoute() as ipr:
            for msg in [m async for m in await ipr.addr("dump")]:
                local = msg.get("address")
                if local is not None and ipaddress.ip_address(local) == wanted:
                    return True
        return False

    return await on_netlink_loop(dump)


def _address_notifications(loop: asyncio.AbstractEventLoop, address: str,
                           changed: asyncio.Event) -> socket.socket | None:
    """Set ``changed`` when ``address`` may have been added to or removed from this node (a notification holds its
    bytes, or notifications were lost); the socket to close, or None (then only the regular checks notice)."""
    packed = ipaddress.ip_address(address).packed
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    except (OSError, AttributeError) as exc:
        log.warning("routes: cannot follow address changes (%s): checking every interval only", exc)
        return None
    try:
        sock.bind((0, RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR))
        sock.setblocking(False)

        def readable() -> None:
            for _ in range(NOTIFY_DRAIN):
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    return
                except OSError:  # ENOBUFS: notifications were lost; one of them may have been this address's
                    changed.set()
                    return
                if not data:
                    return
                if packed in data:  # other addresses (a pod's veth getting its link-local one) wake nothing
                    changed.set()

        loop.add_reader(sock.fileno(), readable)
    except OSError as exc:
        sock.close()
        log.warning("routes: cannot follow address changes (%s): checking every interval only", exc)
        return None
    return sock


def _log(changes: Changes, verb: str) -> None:
    for line in changes.added:
        log.info("routes: installed %s", line)
    for line in changes.removed:
        log.info("routes: %s %s", verb, line)
    for line in changes.failed:
        log.error("routes: could not apply %s", line)


async def run(args: argparse.Namespace) -> int:
    """The ``raven routes`` command: reconcile until SIGTERM/SIGINT, then remove everything. Returns the exit
    status: 0 after a clean removal, 1 if something could not be removed."""
    cfg = settings(args)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    manager = RouteManager({cfg.table})
    routes = [Route(cidr, table=cfg.table, gateway=cfg.gateway) for cidr in cfg.cidrs]
    rules = rules_for(cfg.cidrs, cfg.table, cfg.priority)
    log.info("routes: %d CIDR(s) via %s, table %d, rule priority %d, checked every %gs",
             len(routes), cfg.gateway, cfg.table, cfg.priority, cfg.interval)
    local: bool | None = None
    changed = asyncio.Event()
    notifications = _address_notifications(loop, cfg.gateway, changed)
    try:
        while not stop.is_set():
            try:
                now_local = await asyncio.wait_for(_is_local(cfg.gateway), cfg.timeout)
                if now_local != local:
                    if now_local:
                        log.info("routes: %s is this node's own address (the gateway node, or the holder of the "
                                 "pool's floating address): nothing to install", cfg.gateway)
                    elif local is not None:
                        log.info("routes: %s is no longer this node's address: routing through it", cfg.gateway)
                local = now_local
                changes = await asyncio.wait_for(
                    manager.reconcile([] if local else routes, [] if local else rules), cfg.timeout
                )
                _log(changes, "removed stale")
            except TimeoutError:
                log.error("routes: a check took longer than %gs; trying again in %gs", cfg.timeout, cfg.interval)
            except (NetlinkError, OSError, Layer3Error) as exc:
                log.error("routes: check failed: %s; trying again in %gs", exc, cfg.interval)
            # Until the next check, or an address of this node changing (the floating address came or went).
            changed.clear()
            stopping = asyncio.ensure_future(stop.wait())
            moved = asyncio.ensure_future(changed.wait())
            try:
                await asyncio.wait((stopping, moved), timeout=cfg.interval, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in (stopping, moved):
                    waiter.cancel()
    finally:
        if notifications is not None:
            loop.remove_reader(notifications.fileno())
            notifications.close()
        for sig in signals:
            loop.remove_signal_handler(sig)
        status = await _remove(manager, cfg)
    return status


async def _remove(manager: RouteManager, cfg: RoutesLayer3) -> int:
    log.info("routes: stopping, removing what was installed")
    try:
        removed = await asyncio.wait_for(manager.remove_all(rule_tables={cfg.table}), cfg.timeout)
    except (TimeoutError, NetlinkError, OSError) as exc:
        log.error("routes: could not remove everything: %s", exc or "timed out")
        return 1
    _log(removed, "removed")
    if removed.failed:
        return 1
    log.info("routes: nothing of Raven's is left in table %d", cfg.table)
    return 0


def _setup_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                            format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        logsafe.install()


def command(args: argparse.Namespace) -> int:
    """A synchronous entry point for a command line whose commands are ``func(args) -> int``."""
    _setup_logging(getattr(args, "log_level", "info"))
    return asyncio.run(run(args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raven routes", description=DESCRIPTION)
    configure_parser(parser)
    args = parser.parse_args(argv)
    try:
        return command(args)
    except RavenError as exc:
        print(f"raven routes: {'' if isinstance(exc, ConfigError) else 'error: '}{exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
