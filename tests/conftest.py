"""Shared fixtures: a real gateway and real agents (processes) with simulated GPU nodes on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, Bed, pick_node_port


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


# Under pytest-xdist (scripts/test.sh runs `-n 2 --dist loadgroup`) each module runs whole on one worker, so its
# module-scoped bed starts once; and the tests that hold fixed, machine-wide things run one at a time, on one
# worker, as a single group: every netns testbed (fixed namespace names, addresses, TUN devices, the podman image
# build under /tmp/raven-podman) and the demo and the README guide (fixed ports on 127.0.0.x). Without xdist
# (`-n 0`, `-p no:xdist`) the marks change nothing.
SERIAL_GROUP = "machine-wide"
SERIAL_FILES = {"tests/integration/test_demo.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        serial = path.startswith("tests/e2e/") or path in SERIAL_FILES
        item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP if serial else path))
