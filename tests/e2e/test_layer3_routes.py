"""``raven routes`` for real: a node namespace and a gateway-node namespace on one veth; the command, run as its
own process in the node namespace, installs Raven's table and rule (traffic to a remote CIDR then reaches the
gateway node), repairs them, leaves no duplicate after a crash, and removes everything on SIGTERM. Also the
sysctls: set and restored."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from raven.layer3.config import RAVEN_TABLE
from raven.layer3.routes import Sysctls, forwarding_sysctls
from tests.support.layer3 import PYTHON, ROOT, Namespaces, Netns, namespaces, needs_netns

pytestmark = needs_netns

GATEWAY = "10.88.0.1"
REMOTE = "10.99.0.1"  # an address of a "remote" CIDR, held by the gateway node here


@dataclass
class Bed:
    node: Netns
    gw: Netns
    nets: Namespaces

    async def start(self, *extra: str) -> asyncio.subprocess.Process:
        return await self.node.spawn(
            PYTHON, "-m", "raven.layer3.noderoutes", "--gateway", GATEWAY, "--cidr", "10.99.0.0/16",
            "--cidr", "10.98.0.0/16", "--interval", "0.5", *extra,
            cwd=str(ROOT), env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            stderr=asyncio.subprocess.PIPE,
        )

    def installed(self) -> tuple[list[str], list[int]]:
        routes = sorted(f"{r['dst']} via {r.get('gateway')} table {r.get('table', 'main')}"
                        for r in self.node.raven_routes())
        return routes, [r["priority"] for r in self.node.rules(RAVEN_TABLE)]


WANTED = (["10.98.0.0/16 via 10.88.0.1 table 21057", "10.99.0.0/16 via 10.88.0.1 table 21057"], [RAVEN_TABLE])


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    async with namespaces() as nets:
        node, gw = nets.new("node"), nets.new("gwnode")
        nets.veth(node, "10.88.0.2/24", gw, f"{GATEWAY}/24")
        gw.sh("ip", "addr", "add", f"{REMOTE}/32", "dev", "lo")
        yield Bed(node, gw, nets)


async def _until(check: object, what: str, timeout: float = 15) -> None:
    for _ in range(int(timeout * 10)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout}s")


async def _stop(proc: asyncio.subprocess.Process) -> str:
    proc.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, stderr.decode()
    return stderr.decode()


async def test_installs_repairs_and_removes_on_sigterm(bed: Bed) -> None:
    proc = await bed.start()
    await _until(lambda: bed.installed() == WANTED, "routes and rule installed")
    await bed.node.out("ping", "-c", "2", "-W", "2", REMOTE)  # the remote CIDR now goes to the gateway node
    # someone deletes a route and adds a second rule: the next check repairs both
    bed.node.sh("ip", "route", "del", "10.98.0.0/16", "table", str(RAVEN_TABLE))
    bed.node.sh("ip", "rule", "add", "lookup", str(RAVEN_TABLE), "priority", "100")
    await _until(lambda: bed.installed() == WANTED, "repaired")
    log = await _stop(proc)
    assert bed.installed() == ([], [])
    assert "installed route 10.99.0.0/16 via 10.88.0.1 table 21057 proto 82" in log
    assert "removed rule 21057: from all lookup 21057 (IPv4)" in log
    assert "nothing of Raven's is left in table 21057" in log
    never = await bed.node.spawn("ping", "-c", "1", "-W", "1", REMOTE, stdout=asyncio.subprocess.DEVNULL,
                                 stderr=asyncio.subprocess.DEVNULL)
    assert await never.wait() != 0  # and the node is back to having no route there


async def test_a_restart_after_a_crash_leaves_no_duplicate(bed: Bed) -> None:
    proc = await bed.start()
    await _until(lambda: bed.installed() == WANTED, "installed")
    proc.send_signal(signal.SIGKILL)  # no clean-up runs
    await proc.wait()
    assert bed.installed() == WANTED  # left behind by the crash
    bed.node.sh("ip", "route", "add", "10.97.0.0/16", "via", GATEWAY, "table", str(RAVEN_TABLE), "proto", "82")
    bed.node.sh("ip", "route", "add", "10.96.0.0/16", "via", GATEWAY, "table", str(RAVEN_TABLE))  # not Raven's
    proc = await bed.start()  # the restarted one takes over what is there, drops the stale CIDR
    await _until(lambda: bed.installed() == WANTED, "reconciled, no duplicates")
    await asyncio.sleep(1.2)  # two more checks change nothing
    assert bed.installed() == WANTED
    await _stop(proc)
    assert bed.installed() == ([], [])
    left = bed.node.json("route", "show", "table", str(RAVEN_TABLE))
    assert [r["dst"] for r in left] == ["10.96.0.0/16"]  # a route that is not Raven's is never touched


async def test_on_the_gateway_node_itself_nothing_is_installed(bed: Bed) -> None:
    proc = await bed.gw.spawn(
        PYTHON, "-m", "raven.layer3.noderoutes", "--gateway", GATEWAY, "--cidr", "10.99.0.0/16", "--interval", "0.2",
        cwd=str(ROOT), env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        stderr=asyncio.subprocess.PIPE,
    )
    # Until it has said so (a fixed sleep was too short on a loaded machine: SIGTERM came before its handler).
    assert proc.stderr is not None
    seen = b""
    async with asyncio.timeout(30):
        while b"this node's own address" not in seen:
            line = await proc.stderr.readline()
            assert line, f"raven routes exited early: {seen.decode()}"
            seen += line
    assert bed.gw.raven_routes() == [] and bed.gw.rules(RAVEN_TABLE) == []
    await _stop(proc)


async def test_bad_settings_exit_2_naming_the_field(bed: Bed) -> None:
    proc = await bed.node.spawn(
        PYTHON, "-m", "raven.layer3.noderoutes", "--gateway", GATEWAY, "--cidr", "10.99.0.1/16", "--table", "254",
        cwd=str(ROOT), env={"PYTHONPATH": str(ROOT)}, stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    text = stderr.decode()
    assert "layer3.routes.cidrs.0: '10.99.0.1/16' has host bits set (did you mean 10.99.0.0/16?)" in text
    assert "layer3.routes.table: table 254 is the kernel's 'main' table" in text
    assert bed.installed() == ([], [])


async def test_sysctls_are_set_and_restored(bed: Bed) -> None:
    s = Sysctls(netns=bed.node.name)
    bed.node.sh("sysctl", "-qw", "net.ipv4.conf.v0.rp_filter=1")
    before = {k: s.read(k) for k, _ in forwarding_sysctls("v0", ipv6=True)}
    for key, value in forwarding_sysctls("v0", ipv6=True):
        s.ensure(key, value)
    assert s.read("net.ipv4.ip_forward") == "1" and s.read("net.ipv4.conf.v0.rp_filter") == "2"
    assert not s.ensure("net.ipv4.ip_forward", "1")  # already so: not changed again
    s.restore()
    assert {k: s.read(k) for k in before} == before


async def test_managers_scoped_to_devices_leave_each_other_s_routes(bed: Bed) -> None:
    """Two agents of a pool on one node, each with its own device: the one starting (reconcile towards nothing)
    or stopping (remove_all) never deletes the other's route."""
    from raven.layer3.routes import MAIN_TABLE, Route, RouteManager

    for dev in ("d0", "d1"):
        bed.node.sh("ip", "tuntap", "add", dev, "mode", "tun")  # persistent, gone with the namespace
        bed.node.sh("ip", "link", "set", dev, "up")
    first = RouteManager({MAIN_TABLE}, netns=bed.node.name, devices=["d0"])
    second = RouteManager({MAIN_TABLE}, netns=bed.node.name, devices=["d1"])
    changes = await first.reconcile([Route("10.99.0.0/16", device="d0")], [])
    assert changes.added and not changes.failed
    await second.reconcile([], [])  # the second agent starts
    await second.remove_all()  # and stops
    routes = [(r["dst"], r["dev"]) for r in bed.node.raven_routes()]
    assert routes == [("10.99.0.0/16", "d0")]
    failed = await second.reconcile([Route("10.99.0.0/16", device="d1")], [])  # the same CIDR: in the way
    assert failed.failed and "another route to it is in the way" in failed.failed[0]
    await first.remove_all()
    assert bed.node.raven_routes() == []
