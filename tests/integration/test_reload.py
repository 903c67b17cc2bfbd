"""Configuration reload without a restart: SIGHUP or a changed file; sessions stay up; a bad file changes nothing."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from raven.demo.launch import LocalCluster, PoolSpec, Proc
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.metrics import metric_values
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]


@dataclass
class Bed:
    cluster: LocalCluster
    port: int

    @property
    def gateway(self) -> Proc:
        assert self.cluster.gateway is not None
        return self.cluster.gateway

    @property
    def agent(self) -> Proc:
        return next(iter(self.cluster.agents.values()))

    async def status(self, node: str = "rl-1") -> int:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(f"{self.cluster.front_url}/metrics", headers={"Host": f"{node}:{self.port}"}) as r:
                await r.read()
                return r.status

    async def connects(self) -> float:
        values = await metric_values(self.agent.metrics_port, "raven_agent_connect_attempts_total")
        return sum(values.values())


def edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    tree = yaml.safe_load(path.read_text())
    change(tree)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    port = pick_node_port(HOSTS)
    nodes = [SimNode("rl-1", HOSTS[0], port), SimNode("rl-2", HOSTS[1], port)]
    exporter = SimExporter(nodes)
    await exporter.start()
    # The agent serves rl-1 only at first; rl-2 is added by a reload.
    cluster = LocalCluster(tmp_path_factory.mktemp("reload"), [PoolSpec("pool-r", nodes[:1], agents=1)],
                           allowed_ports=[port, 9100],
                           gateway_settings={"config_watch_interval": 0.5},
                           agent_settings={"config_watch_interval": 0.5})
    try:
        await cluster.start()
        yield Bed(cluster, port)
    finally:
        await cluster.close()
        await exporter.close()


async def test_sighup_takes_over_the_allowlist_without_dropping_the_session(bed: Bed) -> None:
    assert await bed.status() == 200
    connects = await bed.connects()
    edit(bed.gateway.config, lambda t: t["front"].update(allowed_ports=[9100]))
    bed.gateway.process.send_signal(signal.SIGHUP)

    async def refused() -> bool:
        return await bed.status() == 403

    await eventually(refused, timeout=10, what="port no longer allowed")
    assert "configuration reload: took over front.allowed_ports" in bed.gateway.log_tail(30)
    assert await bed.connects() == connects  # the agent never reconnected


async def test_a_changed_file_is_reloaded_without_a_signal(bed: Bed) -> None:
    edit(bed.gateway.config, lambda t: t["front"].update(allowed_ports=[bed.port, 9100]))

    async def allowed() -> bool:
        return await bed.status() == 200

    await eventually(allowed, timeout=10, what="port allowed again")
    assert "changed)" in bed.gateway.log_tail(30)


async def test_an_invalid_file_is_refused_and_the_old_configuration_stays(bed: Bed) -> None:
    good = bed.gateway.config.read_text()
    edit(bed.gateway.config, lambda t: t["front"].update(listen="nowhere", allowed_ports=[9100]))
    bed.gateway.process.send_signal(signal.SIGHUP)
    try:
        await eventually(lambda: "configuration reload (SIGHUP) refused" in bed.gateway.log_tail(40), timeout=10)
        assert "front.listen: expected HOST:PORT, got 'nowhere'" in bed.gateway.log_tail(40)
        assert await bed.status() == 200  # the port stays allowed: nothing of the bad file was taken over
    finally:
        bed.gateway.config.write_text(good)


async def test_settings_that_need_a_restart_are_named(bed: Bed) -> None:
    edit(bed.gateway.config, lambda t: t.update(replica_id="renamed"))
    bed.gateway.process.send_signal(signal.SIGHUP)
    await eventually(lambda: "replica_id changed, which takes effect only after a restart"
                     in bed.gateway.log_tail(40), timeout=10)
    assert await bed.status() == 200


async def test_the_agent_takes_over_a_new_node_list_and_re_registers(bed: Bed) -> None:
    connects = await bed.connects()
    assert await bed.status("rl-2") == 404
    edit(bed.agent.config, lambda t: t["nodes"].append({"name": "rl-2", "address": HOSTS[1]}))
    bed.agent.process.send_signal(signal.SIGHUP)

    async def served() -> bool:
        return await bed.status("rl-2") == 200

    await eventually(served, timeout=10, what="rl-2 served after the agent's reload")
    assert await bed.status("rl-1") == 200
    assert await bed.connects() == connects


async def test_certificate_expiry_is_exported(bed: Bed) -> None:
    for proc, role in ((bed.gateway, "gateway"), (bed.agent, "agent")):
        values = await metric_values(proc.metrics_port, "raven_certificate_expiry_timestamp_seconds")
        roles = {dict(labels)["role"] for labels in values}
        assert roles == {role, "ca"}, values
        assert all(v > 1.7e9 for v in values.values())
