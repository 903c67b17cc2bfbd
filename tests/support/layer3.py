"""Network namespaces for the layer-3 tests: created with unique names, always removed.

:func:`namespaces` is a context manager handing out a :class:`Netns` factory; on exit (also when the test
failed) it kills every process started through it and deletes every namespace it made (with them go their
veth, TUN devices, routes and rules). Traffic stays inside these namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[2]


def netns_skip_reason() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices, routes)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip (scripts/system-deps.sh)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    return None


needs_netns = [pytest.mark.netns, pytest.mark.skipif(netns_skip_reason() is not None,
                                                    reason=netns_skip_reason() or "")]


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


class Netns:
    """One namespace: run commands in it, read its links, routes and rules as JSON."""

    def __init__(self, name: str, owner: Namespaces) -> None:
        self.name = name
        self.owner = owner

    def sh(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run("ip", "netns", "exec", self.name, *argv, check=check)

    def json(self, *argv: str) -> Any:
        out = self.sh("ip", "-j", *argv).stdout.strip()
        return json.loads(out) if out else []

    def links(self, name: str | None = None) -> list[dict[str, Any]]:
        links: list[dict[str, Any]] = self.json("-d", "link", "show")
        return [link for link in links if name is None or link["ifname"] == name]

    def addresses(self, device: str) -> set[str]:
        out: set[str] = set()
        for link in self.json("addr", "show", "dev", device):
            for a in link.get("addr_info", []):
                if a.get("scope") != "link":
                    out.add(f"{a['local']}/{a['prefixlen']}")
        return out

    def raven_routes(self) -> list[dict[str, Any]]:
        routes: list[dict[str, Any]] = []
        for family in ("-4", "-6"):
            routes += self.json(family, "route", "show", "table", "all", "proto", "82")
        return routes

    def rules(self, table: int) -> list[dict[str, Any]]:
        rules: list[dict[str, Any]] = []
        for family in ("-4", "-6"):
            rules += [r for r in self.json(family, "rule", "show") if str(r.get("table")) == str(table)]
        return rules

    async def spawn(self, *argv: str, **kwargs: Any) -> asyncio.subprocess.Process:
        """Start a process in the namespace (killed at the end whatever happens)."""
        proc = await asyncio.create_subprocess_exec("ip", "netns", "exec", self.name, *argv,
                                                    start_new_session=True, **kwargs)
        self.owner.processes.append(proc)
        return proc

    async def out(self, *argv: str, timeout: float = 60) -> str:
        """Run a command to its end (without blocking the event loop) and return its stdout; fail on error."""
        proc = await self.spawn(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
        assert proc.returncode == 0, (
            f"{argv} in {self.name}: exit {proc.returncode}: {stdout.decode()[-2000:]} {stderr.decode()[-2000:]}"
        )
        return stdout.decode()


class Namespaces:
    def __init__(self) -> None:
        self.made: list[Netns] = []
        self.processes: list[asyncio.subprocess.Process] = []

    def new(self, tag: str) -> Netns:
        name = f"rvl3-{os.getpid()}-{len(self.made)}-{tag}"[:40]
        run("ip", "netns", "add", name)
        ns = Netns(name, self)
        self.made.append(ns)
        ns.sh("ip", "link", "set", "lo", "up")
        return ns

    def veth(self, a: Netns, a_addr: str, b: Netns, b_addr: str) -> None:
        """A veth pair between ``a`` (device v0) and ``b`` (device v1), addresses set, both up."""
        run("ip", "link", "add", "v0", "netns", a.name, "type", "veth", "peer", "name", "v1", "netns", b.name)
        a.sh("ip", "addr", "add", a_addr, "dev", "v0")
        b.sh("ip", "addr", "add", b_addr, "dev", "v1")
        a.sh("ip", "link", "set", "v0", "up")
        b.sh("ip", "link", "set", "v1", "up")

    async def cleanup(self) -> None:
        for proc in self.processes:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 10)
        for ns in reversed(self.made):
            run("ip", "netns", "del", ns.name, check=False)
        left = {n.name for n in self.made} & set(run("ip", "netns", "list").stdout.split())
        assert not left, f"namespaces left behind: {left}"


@contextlib.asynccontextmanager
async def namespaces() -> AsyncIterator[Namespaces]:
    made = Namespaces()
    try:
        yield made
    finally:
        await made.cleanup()
