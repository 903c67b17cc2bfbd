"""raven.demo.launch.free_port with RAVEN_PORT_RANGE: ports from the range, in turn, never one that is taken.

A port the kernel picks comes from the ephemeral range that every outgoing connection draws from too: a CI run
lost a test to "Address already in use" between the pick and the gateway's bind. The suite gives each worker a
range of its own below the ephemeral one (tests/conftest.py).
"""

from __future__ import annotations

import os
import socket

import pytest

from raven.demo import launch
from raven.errors import ConfigError


def test_the_suite_runs_with_a_range_of_its_own_below_the_ephemeral_one() -> None:
    span = launch.port_range()
    assert span is not None, os.environ.get("RAVEN_PORT_RANGE")
    low, high = span
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    assert 1024 <= low < high < ephemeral_low
    assert not low <= 10262 <= high and not low <= 9400 <= high  # the guide's and the exporters' fixed ports
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        # A slice of its own: the controller's import of tests/conftest.py set the whole range first, which every
        # worker inherited (each used the whole range before a review caught it).
        worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
        width = (32_000 - 20_000) // workers
        assert (low, high) == (20_000 + worker * width, 20_000 + (worker + 1) * width - 1), (worker, low, high)


def test_ports_come_from_the_range_in_turn_and_skip_a_taken_one(monkeypatch: pytest.MonkeyPatch) -> None:
    span = launch.port_range()
    assert span is not None
    low, high = span  # this worker's own ports: no other worker's server holds one of them
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = low + probe.getsockname()[1] % (high - low - 10)  # some spot in it, not always the same
    monkeypatch.setenv("RAVEN_PORT_RANGE", f"{base}-{base + 9}")
    monkeypatch.setattr(launch, "_cursor", {})
    first = launch.free_port()
    assert base <= first <= base + 9
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + (first - base + 1) % 10))  # the next one in turn is taken
        second = launch.free_port()
        assert second == base + (first - base + 2) % 10
    third = launch.free_port()
    assert third == base + (first - base + 3) % 10  # in turn: the ports just handed out come last


def test_a_full_range_and_a_bad_setting_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setenv("RAVEN_PORT_RANGE", f"{port}-{port}")
        with pytest.raises(OSError, match=f"no port free on 127.0.0.1 in RAVEN_PORT_RANGE {port}-{port}"):
            launch.free_port()
    for bad in ("20000", "30000-20000", "80-90", "a-b", "20000-70000"):
        monkeypatch.setenv("RAVEN_PORT_RANGE", bad)
        with pytest.raises(ConfigError, match="expected LOW-HIGH"):
            launch.free_port()
    monkeypatch.setenv("RAVEN_PORT_RANGE", "")
    assert launch.port_range() is None
