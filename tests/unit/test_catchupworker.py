"""The catch-up's worker process (gateway/catchupworker.py), through the gateway's Backfill: an agent's backlog
served over an in-memory session (agent/backfillserve.py), a real remote-write receiver, a real worker process.
The batch is built in another process, at a lower priority, with the label-set cache kept there across batches; a
worker killed in the middle of a batch, or one that hangs past the deadline, is replaced, and the batch is not
acknowledged but written later, whole; stopping the Backfill leaves no child process, even with a worker that
hangs."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import signal
import sys
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
from tests.support.memsession import pair
from tests.support.polling import eventually
from tests.support.rwreceiver import Receiver as FakeReceiver

NODES = ("n1", "n2", "n3")
TICKS = 12
PORT = 9400


def _cached_targets() -> int:
    """In the worker: the targets its label-set cache holds."""
    return len(catchupworker._series)


def _gone(pid: int) -> bool:
    """No such process (ended and reaped: not even a zombie)."""
    return not os.path.exists(f"/proc/{pid}")


def _ended(pid: int) -> bool:
    """Ended: gone, or a zombie (one whose parent was killed waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _children(pid: int) -> dict[int, str]:
    """The process's children: pid -> command line."""
    out: dict[int, str] = {}
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            for child in f.read().split():
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as cmd:
                        out[int(child)] = cmd.read().replace(b"\0", b" ").decode()
                except FileNotFoundError:
                    pass
    return out


GATEWAY = """
import asyncio, os
from gateway.catchupworker import CatchupWorker
async def main():
    worker = CatchupWorker(30.0)
    print(await worker.call(os.getpid), flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
"""


@dataclass
class Bed:
    backfill: Backfill
    backlog: Backlog
    receiver: FakeReceiver
    acks: list[int]  # the acknowledgement each backfill OPEN carried, in order
    task: asyncio.Task[None]

    @property
    def worker(self) -> catchupworker.CatchupWorker:
        return self.backfill.worker

    def written(self) -> int:
        """Scrapes the receiver holds (each node's DCGM_FI_DEV_GPU_TEMP of GPU 0 once per scrape)."""
        return sum(len(v) for k, v in self.receiver.samples.items()
                   if dict(k).get("__name__") == "DCGM_FI_DEV_GPU_TEMP" and dict(k).get("gpu") == "0")


@asynccontextmanager
async def bed(batch_bytes: int = 1 << 20, **settings: object) -> AsyncIterator[Bed]:
    now = int(time.time() * 1000)
    backlog = Backlog()
    models = {n: NodeModel(n, gpus=2, processes_per_gpu=1) for n in NODES}
    for tick in range(TICKS):
        for node, model in models.items():
            backlog.add(node, PORT, now - 60_000 + tick * 1000, model.render(tick))
    server = BackfillServer(backlog, BackfillMetrics(CollectorRegistry()), 1e9, batch_bytes=batch_bytes)
    acks: list[int] = []

    def on_open(stream: Stream) -> None:
        acks.append(bf.parse_ack(stream.open.target))
        server.on_open(stream)

    receiver = FakeReceiver()
    await receiver.start()
    gw, ag, tasks = await pair(on_open)
    cfg = GatewayBackfill(receivers=[Receiver(url=receiver.url)], jobs={PORT: "edge-dcgm"}, poll_interval=0.2,
                          retry_max=0.2, **settings)
    registry = Registry()
    for node in NODES:
        registry.nodes[node] = NodeEntry(node, "10.0.0.1", "pool-a")
    backfill = Backfill(cfg, registry, CollectorRegistry())
    await backfill.start()
    receiver.requests = 0  # not the start-up probe's
    session = AgentSession("agent-1", "s" * 32, frozenset({"pool-a"}), gw)
    task = asyncio.get_running_loop().create_task(backfill.session(session))
    try:
        yield Bed(backfill, backlog, receiver, acks, task)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await backfill.stop()
        await gw.close("done")
        await ag.close("done")
        await asyncio.gather(*tasks, return_exceptions=True)
        await receiver.close()


async def test_the_batches_are_built_in_a_lower_priority_process_that_keeps_the_label_sets() -> None:
    async with bed(batch_bytes=8 * 1024) as b:  # several batches
        await eventually(lambda: b.written() == len(NODES) * TICKS and not b.backlog.scrapes, 60,
                         "every kept scrape written and acknowledged")
        pid = b.worker.pid
        assert pid is not None and pid != os.getpid()
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + catchupworker.NICENESS
        assert len(set(b.acks)) >= 3  # two batches at least, each acknowledged
        assert await b.worker.call(_cached_targets) == len(NODES)  # kept there, across the batches
        assert b.worker.pid == pid  # one worker throughout


async def test_a_worker_killed_in_the_middle_of_a_batch_is_replaced_and_the_batch_written_later(
        caplog: pytest.LogCaptureFixture) -> None:
    async with bed(samples_per_request=100) as b:  # one batch, many requests
        b.receiver.status = 503  # the first request waits (retried): the batch is under way
        await eventually(lambda: b.receiver.requests > 0 and b.worker.pid is not None, 60, "the first request")
        first = b.worker.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await eventually(lambda: _gone(first), 10, "the worker killed")
        b.receiver.status = 204
        await eventually(lambda: b.written() == len(NODES) * TICKS and not b.backlog.scrapes, 60,
                         "the batch written again, whole, and acknowledged")
        assert b.acks[:2] == [0, 0]  # asked again: not acknowledged after the loss
        assert b.worker.pid not in (None, first)
        assert not b.task.done()
        assert "not written: the worker process was killed by SIGKILL" in caplog.text
        assert "agent-1 (pools pool-a)" in caplog.text


async def test_a_worker_that_hangs_is_killed_at_the_deadline_and_the_batch_written_later(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with bed(samples_per_request=100, build_timeout=1.0) as b:
        b.receiver.status = 503
        await eventually(lambda: b.receiver.requests > 0 and b.worker.pid is not None, 60, "the first request")
        first = b.worker.pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)  # a build that never ends, as far as the gateway can tell
        b.receiver.status = 204
        await eventually(lambda: _gone(first), 15, "the hung worker killed")
        await eventually(lambda: b.written() == len(NODES) * TICKS and not b.backlog.scrapes, 60,
                         "the batch written again, whole, and acknowledged")
        assert b.acks[:2] == [0, 0]
        assert b.worker.pid not in (None, first)
        assert "took longer than 1 s (build_timeout): the worker process was killed" in caplog.text


@pytest.mark.parametrize("hung", [False, True])
async def test_stopping_leaves_no_child_process(hung: bool) -> None:
    async with bed() as b:
        await eventually(lambda: b.written() == len(NODES) * TICKS, 60, "the backlog written")
        pid = b.worker.pid
        assert pid is not None and not _gone(pid)
        if hung:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        await b.backfill.stop()
        assert time.monotonic() - started < catchupworker.STOP_GRACE + 2
        await eventually(lambda: _gone(pid), 10, "the worker process ended")
        # What is left of multiprocessing is its resource tracker (one for the process's life), no worker.
        assert not [cmd for cmd in _children(os.getpid()).values() if "spawn_main" in cmd]
        with pytest.raises(catchupworker.WorkerLost, match="stopping"):
            await b.worker.call(_cached_targets)


async def test_a_gateway_killed_outright_takes_its_worker_with_it() -> None:
    """SIGKILL gives the gateway no time to stop its worker: the worker sees it gone and ends."""
    gateway = await asyncio.create_subprocess_exec(sys.executable, "-c", GATEWAY, stdout=asyncio.subprocess.PIPE)
    try:
        assert gateway.stdout is not None
        async with asyncio.timeout(60):
            pid = int(await gateway.stdout.readline())
        assert pid != gateway.pid and not _ended(pid)
        children = _children(gateway.pid)  # the worker, and multiprocessing's resource tracker
        assert pid in children and len(children) == 2, children
    finally:
        gateway.kill()
        await gateway.wait()
    await eventually(lambda: all(_ended(child) for child in children), 10, "the children of a killed gateway ended")


async def test_a_batch_that_does_not_decode_is_refused_with_its_reason_and_the_worker_lives_on() -> None:
    worker = catchupworker.CatchupWorker(30.0)
    try:
        good = bf.encode(bf.Scrape(1, 1, 1, PORT, "n1", b""))
        for body, why in [(good[:-1], "ends inside an entry"), (b"\x09" + good[1:], "unknown backfill entry type"),
                          (good * 3, "over 40 bytes")]:
            with pytest.raises(bf.BackfillError, match=why):
                await worker.batch().decode(body, 1024, 40)
        assert (await worker.batch().decode(good, 1024, 40)).scrapes == 1
        assert worker.generation == 0  # one worker throughout
    finally:
        await worker.close()
