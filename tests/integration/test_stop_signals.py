"""A SIGTERM that comes while a service is still starting stops it cleanly once started (raven/stopsignals.py).

Before, the handlers came after the start-up: a signal during it killed the process by the signal, with what it
had set up (an agent's forwarding, routes and sysctls) left behind. Real signals, sent to this process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from agent.service import Agent
from raven import pki
from raven.config import AgentConfig, build
from raven.demo.launch import free_port
from raven.stopsignals import StopSignals

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]


async def test_a_signal_while_starting_stops_once_started_and_only_once() -> None:
    stops: list[float] = []
    loop = asyncio.get_running_loop()
    with StopSignals(lambda: stops.append(loop.time())) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.2)  # still starting: the signals are kept, the process lives
        assert stops == [] and signals.pending == signal.SIGTERM
        started = loop.time()
        signals.started()
        assert len(stops) == 1 and stops[0] >= started
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.1)
        assert len(stops) == 1  # once


async def test_a_signal_once_started_stops_at_once() -> None:
    stopped = asyncio.Event()
    with StopSignals(stopped.set) as signals:
        signals.started()
        os.kill(os.getpid(), signal.SIGTERM)
        async with asyncio.timeout(5):
            await stopped.wait()


class SlowLayer3:
    """Stands in for agent/layer3.py: its start takes a while (pyroute2 on a busy node), and it must be undone."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.closed = False

    async def start(self) -> None:
        self.started.set()
        await asyncio.sleep(1.0)

    async def close(self) -> None:
        self.closed = True


async def test_an_agent_sent_sigterm_while_setting_up_layer3_undoes_it_and_exits_0(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pki.create_ca(tmp_path)
    pki.issue(tmp_path, tmp_path, "agent", "a1", pools=["pool-a"])
    path = tmp_path / "agent.yaml"
    path.write_text(f"pool: pool-a\nmetrics_listen: 127.0.0.1:{free_port()}\n"
                    f"gateway: {{url: 'wss://127.0.0.1:{free_port()}/tunnel'}}\n"
                    "tls: {cert: a1.pem, key: a1-key.pem, ca: ca.pem}\n")
    agent = Agent(build(AgentConfig, path, environ={}))
    layer3 = SlowLayer3()
    fake: Any = layer3
    agent.layer3 = fake
    caplog.set_level(logging.INFO)
    run = asyncio.create_task(agent.run())
    async with asyncio.timeout(10):
        await layer3.started.wait()
        os.kill(os.getpid(), signal.SIGTERM)  # before the fix: this process died by the signal here
        assert await run == 0
    assert layer3.closed
    assert "SIGTERM while starting: stopping once started" in caplog.text
    assert "agent a1 stopped" in caplog.text
