"""Shared fixtures: a real gateway and real agents (processes) with simulated GPU nodes on loopback."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, Bed, pick_node_port

# Ports the tests' servers take (raven.demo.launch.free_port, inherited by the processes they start): below the
# kernel's ephemeral range, so that no outgoing connection takes one between its pick and its bind, and a slice
# of their own for each pytest-xdist worker, so that two workers never pick the same one.
PORTS_LOW, PORTS_HIGH = 20_000, 32_000
if os.environ.get("PYTEST_XDIST_WORKER"):
    # A worker slices whatever range it inherited: the controller's own import of this file has already set the
    # whole range in the environment the workers start with (or the user set one).
    from raven.demo.launch import port_range

    _low, _high = port_range() or (PORTS_LOW, PORTS_HIGH - 1)
    _workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    _worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw") or 0) % _workers
    _slice = (_high - _low + 1) // _workers
    os.environ["RAVEN_PORT_RANGE"] = f"{_low + _worker * _slice}-{_low + (_worker + 1) * _slice - 1}"
elif "RAVEN_PORT_RANGE" not in os.environ:
    os.environ["RAVEN_PORT_RANGE"] = f"{PORTS_LOW}-{PORTS_HIGH - 1}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    port = pick_node_port(HOSTS)
    tcp_port = pick_node_port(HOSTS)  # for CONNECT tests: a TLS server stands in for a kubelet
    pool_a = [SimNode(f"edge-a-{i}", HOSTS[i - 1], port) for i in (1, 2, 3)]
    # pool-b has one agent, so that two streams are sure to share a session; edge-b-2 is large.
    pool_b = [SimNode("edge-b-1", HOSTS[3], port), SimNode("edge-b-2", HOSTS[4], port, size=4 * 1024 * 1024)]
    exporter = SimExporter(pool_a + pool_b)
    await exporter.start()
    workdir = tmp_path_factory.mktemp("raven-test")
    cluster = LocalCluster(
        workdir,
        [PoolSpec("pool-a", pool_a, agents=2), PoolSpec("pool-b", pool_b, agents=1)],
        allowed_ports=[port, tcp_port, 9100],
        # POST is allowed here only so that request-body paths can be tested; the default is GET and HEAD.
        gateway_settings={"front": {"request_timeout": 10, "allow_connect": True,
                                    "allowed_methods": ["GET", "HEAD", "POST"]},
                          "limits": {"heartbeat_interval": 0.5, "heartbeat_timeout": 2.5}},
        agent_settings={"allow_connect": True, "allowed_methods": ["GET", "HEAD", "POST"]},
    )
    try:
        await cluster.start()
        yield Bed(cluster, exporter, port, tcp_port)
    finally:
        await cluster.close()
        await exporter.close()



@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: without it (-p no:xdist) nothing to schedule
def pytest_configure(config: pytest.Config) -> None:
    """Refuse to test a compiled module older than its source: Python would import the build, not the edit."""
    if os.environ.get("RAVEN_BUILD") == "pure":
        return
    from raven.build import stale

    old = stale()
    if old:
        more = " ..." if len(old) > 4 else ""
        pytest.exit(f"compiled modules older than their sources ({', '.join(old[:4])}{more}): run bash "
                    "scripts/setup.sh to build them again, or RAVEN_BUILD=pure to test the sources", returncode=4)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (scripts/test.sh: -n 2), each module whole on one worker and the tests that hold
    machine-wide things one at a time: tests/support/xdistgroups.py."""
    from tests.support.xdistgroups import make_scheduler

    return make_scheduler(config, log)
