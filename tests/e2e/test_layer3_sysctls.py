"""Two real agents with layer 3 (IPv4 and IPv6) on one gateway node share its forwarding sysctls.

Each agent process opens its TUN device and switches forwarding on at start (no gateway is needed for that: the
URL leads nowhere, and the agents keep redialling). Whichever stops first, forwarding stays on for the other, for
IPv4 and IPv6 alike; when the last one has stopped, both are back at the value found before the first started.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import yaml

from raven import pki
from tests.support.layer3 import PYTHON, ROOT, Namespaces, Netns, namespaces, needs_netns

pytestmark = needs_netns

V4, V6 = "net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"
AGENTS = [("agent-s-1", "raven0", "10.220.255.1/32", "fd20::1/128", 10266),
          ("agent-s-2", "raven1", "10.220.255.2/32", "fd20::2/128", 10267)]


def forwarding(ns: Netns) -> tuple[str, str]:
    return (ns.sh("sysctl", "-n", V4).stdout.strip(), ns.sh("sysctl", "-n", V6).stdout.strip())


def write_configs(workdir: Path) -> None:
    certs = workdir / "pki"
    pki.create_ca(certs, common_name="Raven sysctl test CA")
    for name, device, v4, v6, port in AGENTS:
        pki.issue(certs, certs, "agent", name, pools=["site-s"], cidrs=["10.220.0.0/16", "fd20::/64"], days=1)
        (workdir / f"{name}.yaml").write_text(yaml.safe_dump({
            "pool": "site-s",
            "gateway": {"url": "wss://127.0.0.1:9/tunnel", "server_name": "raven-gateway",
                        "backoff_initial": 0.5, "backoff_max": 2},
            "metrics_listen": f"127.0.0.1:{port}",
            "tls": {"cert": str(certs / f"{name}.pem"), "key": str(certs / f"{name}-key.pem"),
                    "ca": str(certs / "ca.pem")},
            "drain_grace": 1,
            "layer3": {"enabled": True, "device": device, "addresses": [v4, v6],
                       "cidrs": ["10.220.0.0/16", "fd20::/64"]},
        }))


async def start(ns: Netns, workdir: Path, name: str, device: str) -> asyncio.subprocess.Process:
    log = (workdir / f"{name}.log").open("ab")
    try:
        proc = await ns.spawn(PYTHON, "-m", "raven.cli", "agent", "--config", str(workdir / f"{name}.yaml"),
                              cwd=str(ROOT), env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                              stdout=log, stderr=log)
    finally:
        log.close()
    for _ in range(300):
        if ns.links(device) and ns.sh("ip", "-6", "addr", "show", "dev", device).stdout.count("fd20::") == 1:
            return proc
        assert proc.returncode is None, (workdir / f"{name}.log").read_text()[-3000:]
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name}: no device {device}: {(workdir / f'{name}.log').read_text()[-3000:]}")


async def stop(proc: asyncio.subprocess.Process) -> None:
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 30) == 0


@pytest.mark.parametrize("first_to_stop", [0, 1])
async def test_forwarding_is_restored_by_the_last_agent_only(tmp_path: Path, first_to_stop: int) -> None:
    write_configs(tmp_path)
    nets: Namespaces
    async with namespaces() as nets:
        ns = nets.new("gw2")
        ns.sh("sysctl", "-qw", f"{V4}=0")
        ns.sh("sysctl", "-qw", f"{V6}=0")
        procs = [await start(ns, tmp_path, name, device) for name, device, *_ in AGENTS]
        assert forwarding(ns) == ("1", "1")
        await stop(procs[first_to_stop])
        logs = (tmp_path / f"{AGENTS[first_to_stop][0]}.log").read_text()
        assert forwarding(ns) == ("1", "1"), logs[-3000:]  # the other still forwards, IPv6 too
        await stop(procs[1 - first_to_stop])
        assert forwarding(ns) == ("0", "0")  # back at what was found before the first
        # And when it was on before the first: it stays on.
        ns.sh("sysctl", "-qw", f"{V4}=1")
        procs = [await start(ns, tmp_path, name, device) for name, device, *_ in AGENTS]
        for proc in procs:
            await stop(proc)
        assert forwarding(ns) == ("1", "0")
