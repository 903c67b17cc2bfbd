"""The catch-up's worker process (gateway/catchupworker.py) shared by several sessions: one call in it at a time,
each with its own deadline from its turn. A worker lost with several sessions' batches in flight costs each of
them its batch (asked for again, written later), never its puller; a call waiting behind slow ones, or behind a
step whose session ended, is not killed for their time; an unexpected error in a batch is logged with its agent
and pools and the puller polls on."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from agent.backfillserve import BackfillServer
from agent.backlog import Backlog
from agent.outage import BackfillMetrics
from gateway import catchupworker
from gateway.backfill import Backfill
from gateway.registry import AgentSession, NodeEntry, Registry
from raven.config.backfill import GatewayBackfill, Receiver
from raven.demo.dcgm_page import NodeModel
from raven.protocol import backfill as bf
from raven.transport.stream import Stream
from raven.transport.tunnel import Tunnel
from tests.support.memsession import pair
from tests.support.polling import eventually
from tests.support.rwreceiver import Receiver as FakeReceiver

TICKS = 6
PORT = 9400


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@dataclass
class Agent:
    name: str
    nodes: tuple[str, ...]
    backlog: Backlog
    acks: list[int]  # the acknowledgement each backfill OPEN carried, in order
    session: AgentSession
    task: asyncio.Task[None] | None = None


@dataclass
class Fleet:
    backfill: Backfill
    receiver: FakeReceiver
    agents: list[Agent]

    def start(self, agents: slice = slice(None)) -> None:
        loop = asyncio.get_running_loop()
        for a in self.agents[agents]:
            a.task = loop.create_task(self.backfill.session(a.session))

    def written(self) -> int:
        """Scrapes the receiver holds (each node's DCGM_FI_DEV_GPU_TEMP of GPU 0 once per scrape)."""
        return sum(len(v) for k, v in self.receiver.samples.items()
                   if dict(k).get("__name__") == "DCGM_FI_DEV_GPU_TEMP" and dict(k).get("gpu") == "0")

    def ended(self) -> bool:
        """Some agent's puller ended."""
        return any(a.task is not None and a.task.done() for a in self.agents)

    def all_written(self) -> bool:
        return (self.written() == sum(len(a.nodes) for a in self.agents) * TICKS
                and not any(a.backlog.scrapes for a in self.agents))


@asynccontextmanager
async def fleet(agents: int, **settings: object) -> AsyncIterator[Fleet]:
    """``agents`` sessions, each of its own pool with two nodes and a backlog of TICKS scrapes of each."""
    now = int(time.time() * 1000)
    receiver = FakeReceiver()
    await receiver.start()
    cfg = GatewayBackfill(receivers=[Receiver(url=receiver.url)], jobs={PORT: "edge-dcgm"}, poll_interval=0.2,
                          retry_max=0.2, **settings)
    registry = Registry()
    backfill = Backfill(cfg, registry, CollectorRegistry())
    await backfill.start()
    receiver.requests = 0
    made: list[Agent] = []
    ends: list[tuple[Tunnel, Tunnel, list[asyncio.Task[None]]]] = []
    try:
        for i in range(agents):
            nodes = (f"a{i}-n1", f"a{i}-n2")
            backlog = Backlog()
            for node in nodes:
                registry.nodes[node] = NodeEntry(node, "10.0.0.1", f"pool-{i}")
                model = NodeModel(node, gpus=2, processes_per_gpu=1)
                for tick in range(TICKS):
                    backlog.add(node, PORT, now - 60_000 + tick * 1000, model.render(tick))
            server = BackfillServer(backlog, BackfillMetrics(CollectorRegistry()), 1e9, batch_bytes=1 << 20)
            acks: list[int] = []

            def on_open(stream: Stream, acks: list[int] = acks, server: BackfillServer = server) -> None:
                acks.append(bf.parse_ack(stream.open.target))
                server.on_open(stream)

            gw, ag, tasks = await pair(on_open)
            ends.append((gw, ag, tasks))
            made.append(Agent(f"agent-{i}", nodes, backlog, acks,
                              AgentSession(f"agent-{i}", f"{i}" * 32, frozenset({f"pool-{i}"}), gw)))
        yield Fleet(backfill, receiver, made)
    finally:
        running = [a.task for a in made if a.task is not None]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        assert all(task.cancelled() for task in running)  # a puller's own cancellation still ends it
        await backfill.stop()
        for gw, ag, tasks in ends:
            await gw.close("done")
            await ag.close("done")
            await asyncio.gather(*tasks, return_exceptions=True)
        await receiver.close()


async def test_a_worker_lost_with_several_sessions_batches_in_flight_costs_each_its_batch_not_its_puller(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with fleet(4, concurrency=4, build_timeout=3.0) as f:
        pid = await f.backfill.worker.call(os.getpid)  # started
        os.kill(pid, signal.SIGSTOP)  # hung: every session's batch reaches it and waits
        f.start(slice(0, 1))
        await eventually(lambda: bool(f.agents[0].acks), 30, "the first agent asked")
        await asyncio.sleep(1.0)  # its batch at the worker; the others' come later, as sessions' do
        f.start(slice(1, None))
        # Killed at the first batch's deadline, the executor shut down at once: without turns, the batches queued
        # behind it were cancelled under their sessions (CancelledError), and those pullers ended without a word.
        await eventually(lambda: _gone(pid), 15, "the hung worker killed")
        assert "took longer than 3 s (build_timeout)" in caplog.text
        await eventually(lambda: f.all_written() or f.ended(), 90,
                         "every agent's batch written again, whole, and acknowledged")
        assert not [a.name for a in f.agents if a.task is None or a.task.done()], "pullers ended"
        for a in f.agents:
            assert a.acks[:2] == [0, 0], a.name  # asked again: not acknowledged after the loss
            assert f"backfill from agent {a.name} (pools pool-{a.name[-1]}) not written" in caplog.text
        assert f.backfill.worker.pid not in (None, pid)


async def test_a_call_waiting_behind_slow_ones_is_not_killed_for_their_time() -> None:
    worker = catchupworker.CatchupWorker(2.0)
    try:
        pid = await worker.call(os.getpid)
        # Three steps of 1.2 s each, well within the 2 s deadline; together 3.6 s.
        await asyncio.gather(*(worker.call(time.sleep, 1.2) for _ in range(3)))
        assert worker.generation == 0 and worker.pid == pid  # none killed
    finally:
        await worker.close()


async def test_a_step_whose_caller_gave_up_keeps_its_turn_and_is_killed_at_its_own_deadline(
        caplog: pytest.LogCaptureFixture) -> None:
    worker = catchupworker.CatchupWorker(2.0)
    try:
        pid = await worker.call(os.getpid)
        slow = asyncio.create_task(worker.call(time.sleep, 1.6))
        await asyncio.sleep(0.3)
        slow.cancel()  # its session ended: the step goes on in the worker
        await worker.call(time.sleep, 1.0)  # 1.3 s behind it, and 1 s of its own: within its 2 s
        assert worker.generation == 0 and worker.pid == pid
        hung = asyncio.create_task(worker.call(time.sleep, 60))
        await asyncio.sleep(0.3)
        hung.cancel()
        started = time.monotonic()
        assert await worker.call(os.getpid) not in (pid, None)  # a new worker, after the hung step's deadline
        assert 1.0 < time.monotonic() - started < 2.0 + catchupworker.START_TIME
        assert worker.generation == 1
        assert "a step of a batch whose session ended took longer than 2 s" in caplog.text
    finally:
        await worker.close()


@pytest.mark.parametrize("error", [RuntimeError("boom"), asyncio.CancelledError()], ids=["error", "cancelled"])
async def test_an_unexpected_error_in_a_batch_is_logged_and_the_puller_polls_on(
        error: BaseException, caplog: pytest.LogCaptureFixture) -> None:
    async with fleet(1) as f:
        write = f.backfill.receivers.write
        failed: list[bool] = []

        async def once(body: bytes, parts: list[bytes]) -> int:
            if not failed:
                failed.append(True)
                raise error
            return await write(body, parts)

        f.backfill.receivers.write = once  # type: ignore[method-assign]
        f.start()
        await eventually(f.all_written, 60, "the batch written again, whole, and acknowledged")
        a = f.agents[0]
        assert failed and a.task is not None and not a.task.done()
        assert a.acks[:2] == [0, 0]
        assert (f"backfill from agent agent-0 (pools pool-0) not written: unexpected {type(error).__name__}"
                in caplog.text)
