"""The TUN device for real, in network namespaces: created with its addresses and MTU, removed on close,
reused or replaced after a crash (never two), and never mistaken for someone else's device."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import pytest

from raven.layer3.errors import Layer3Error
from raven.layer3.tun import TunDevice
from tests.support.layer3 import PYTHON, ROOT, Namespaces, namespaces, needs_netns

pytestmark = needs_netns


@pytest.fixture
async def nets() -> AsyncIterator[Namespaces]:
    async with namespaces() as made:
        yield made


async def test_created_with_addresses_and_mtu_and_removed_on_close(nets: Namespaces) -> None:
    ns = nets.new("tun")
    dev = await TunDevice.open("raven0", addresses=["10.77.0.1/24", "fd00:77::1/64"], mtu=1392, netns=ns.name)
    try:
        [link] = ns.links("raven0")
        assert link["mtu"] == 1392
        assert "UP" in link["flags"]
        assert link["linkinfo"]["info_kind"] == "tun"
        assert link["linkinfo"]["info_data"]["type"] == "tun"
        assert link["linkinfo"]["info_data"]["pi"] is False
        assert link["linkinfo"]["info_data"]["persist"] is False
        assert ns.addresses("raven0") == {"10.77.0.1/24", "fd00:77::1/64"}
        assert not dev.reused
    finally:
        await dev.close()
    assert ns.links("raven0") == []
    await dev.close()  # twice is fine


async def test_a_persistent_leftover_is_reused_not_duplicated(nets: Namespaces) -> None:
    """What a crash of something that made the device persistent leaves: reused, stale address removed, and
    gone with Raven's close."""
    ns = nets.new("leftover")
    ns.sh("ip", "tuntap", "add", "dev", "raven0", "mode", "tun")
    ns.sh("ip", "addr", "add", "10.9.9.9/24", "dev", "raven0")
    dev = await TunDevice.open("raven0", addresses=["10.77.0.1/24"], mtu=1400, netns=ns.name)
    try:
        assert dev.reused
        [link] = ns.links("raven0")
        assert link["mtu"] == 1400 and link["linkinfo"]["info_data"]["persist"] is False
        assert ns.addresses("raven0") == {"10.77.0.1/24"}
    finally:
        await dev.close()
    assert ns.links("raven0") == []


async def test_a_tap_leftover_is_replaced(nets: Namespaces) -> None:
    ns = nets.new("tap")
    ns.sh("ip", "tuntap", "add", "dev", "raven0", "mode", "tap")
    async with await TunDevice.open("raven0", addresses=["10.77.0.1/24"], mtu=1392, netns=ns.name):
        [link] = ns.links("raven0")
        assert link["linkinfo"]["info_data"]["type"] == "tun"
    assert ns.links("raven0") == []


async def test_a_device_that_is_not_a_tun_is_never_deleted(nets: Namespaces) -> None:
    ns = nets.new("veth")
    ns.sh("ip", "link", "add", "raven0", "type", "veth", "peer", "name", "other0")
    with pytest.raises(Layer3Error, match="is a veth, not a TUN"):
        await TunDevice.open("raven0", addresses=["10.77.0.1/24"], mtu=1392, netns=ns.name)
    assert len(ns.links("raven0")) == 1


async def test_a_device_in_use_is_not_taken_over(nets: Namespaces) -> None:
    ns = nets.new("busy")
    async with await TunDevice.open("raven0", addresses=["10.77.0.1/24"], mtu=1392, netns=ns.name):
        with pytest.raises(Layer3Error, match="in use by another process"):
            await TunDevice.open("raven0", addresses=["10.77.0.1/24"], mtu=1392, netns=ns.name)
        assert len(ns.links("raven0")) == 1


async def test_a_killed_process_leaves_no_device_and_a_restart_makes_one(nets: Namespaces) -> None:
    """SIGKILL (no clean-up code runs): the kernel removes the non-persistent device with the fd."""
    ns = nets.new("crash")
    code = (
        "import asyncio, sys\n"
        "from raven.layer3.tun import TunDevice\n"
        "async def main():\n"
        "    await TunDevice.open('raven0', addresses=['10.77.0.1/24'], mtu=1392)\n"
        "    print('up', flush=True)\n"
        "    await asyncio.sleep(3600)\n"
        "asyncio.run(main())\n"
    )
    proc = await ns.spawn(PYTHON, "-c", code, stdout=asyncio.subprocess.PIPE, cwd=str(ROOT),
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"up"
    assert len(ns.links("raven0")) == 1
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    for _ in range(50):
        if not ns.links("raven0"):
            break
        await asyncio.sleep(0.1)
    assert ns.links("raven0") == []
    async with await TunDevice.open("raven0", addresses=["10.77.0.1/24"], mtu=1392, netns=ns.name) as dev:
        assert not dev.reused and len(ns.links("raven0")) == 1


async def test_bad_arguments_are_refused_before_touching_anything(nets: Namespaces) -> None:
    ns = nets.new("bad")
    with pytest.raises(Layer3Error, match="not a valid device name"):
        await TunDevice.open("a/b", mtu=1392, netns=ns.name)
    with pytest.raises(Layer3Error, match="MTU"):
        await TunDevice.open("raven0", mtu=70000, netns=ns.name)
    with pytest.raises(Layer3Error, match="ADDRESS/PREFIX"):
        await TunDevice.open("raven0", addresses=["nonsense"], mtu=1392, netns=ns.name)
    assert ns.links("raven0") == []
