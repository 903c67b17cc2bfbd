"""The catch-up's CPU work in a process of its own, so that live scrapes through the gateway do not wait for it.

Turning kept pages into remote-write requests (decoding the batch, decompressing, parsing, encoding:
gateway/catchupbuild.py) is Python: in a thread of the gateway's process it holds the interpreter lock, and the
event loop, which serves every live scrape, waits for it at every turn. Here it runs in ONE worker process
(concurrent.futures.ProcessPoolExecutor, started with 'spawn': never a fork of the running event loop and its
threads) at a lower CPU priority (``os.nice``, :data:`NICENESS`), so that when the cores are busy the kernel
runs the live path first. The worker keeps what the targets' pages taught (pagewrite.SeriesCache) across batches.

What crosses to it is plain data: the batch's body as the agent sent it (its entries in their wire encoding:
pickling 1,500 entry objects took 15-19 ms of the gateway's CPU under the lock, the body 1 ms, and the decoding
moves out too), the node -> pool map for the batch's nodes restricted to the session's own pools, now, and the
settings the build needs (:class:`~gateway.catchupbuild.BuildSettings`). What comes back: one request at a time
(body, parts, samples), the build's CPU time, the drops by reason, the batch's last sequence number.

One call is in the worker at a time (the others wait for their turn, all sessions together), and each has a
deadline (``backfill.build_timeout``) from its turn: its own run, never its wait behind other batches. Past it the
worker is killed, and the next call starts a new one; a worker that dies (BrokenProcessPool) is replaced the same
way. Either way every batch it held, under way or waiting for its turn, raises :class:`WorkerLost`: it is not
acknowledged, and the agent sends it again. A call whose caller gave up on it (its session ended) still has its
turn until its step ends or its deadline passes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Final, TypeVar

from gateway import pagewrite
from gateway.catchupbuild import Builder, BuildSettings, Request
from raven.errors import RavenError
from raven.protocol import backfill as bf

log = logging.getLogger("raven.gateway.backfill")

NICENESS: Final = 10  # the worker's CPU priority below the gateway's (nice(2)): the live path first
MAX_BATCHES: Final = 64  # batches a worker holds (the gateway has backfill.concurrency under way, at most 64)
STOP_GRACE: Final = 2.0  # seconds a stopping worker has to finish its step before it is killed
START_TIME: Final = 30.0  # seconds a new worker has to start (an interpreter and its imports), beyond the deadline
LOST_MEANWHILE: Final = "the worker process that held the batch was lost meanwhile; the batch is asked for again"
T = TypeVar("T")


class WorkerLost(RavenError):
    """The worker process died or was killed while it held the batch: the batch is not acknowledged."""


@dataclass(slots=True)
class Decoded:
    pid: int  # the worker's
    scrapes: int
    nodes: list[str]  # the batch's nodes, each once


@dataclass(slots=True)
class Step:
    request: Request | None  # None: the batch is done
    cpu: float  # seconds of CPU it took
    dropped: dict[str, int]  # reason -> scrapes, so far
    last_seq: int


# ---------------------------------------------------------------- in the worker process

_series = pagewrite.SeriesCache()  # what the targets' pages taught, for their next ones
_batches: dict[int, list[bf.Entry] | Builder] = {}  # batch id -> its entries, then its builder


def _init(niceness: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C at the gateway's terminal is the gateway's to handle
    os.nice(niceness)
    parent = multiprocessing.parent_process()
    if parent is not None:  # the worker holds its queue's both ends: a dead gateway is no end of input to it
        threading.Thread(target=_end_with, args=(parent,), name="parent-watch", daemon=True).start()


def _end_with(parent: BaseProcess) -> None:
    """End this process when ``parent`` (the gateway) has ended, even killed."""
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(1)


def _decode(batch: int, body: bytes, max_entry: int, max_body: int) -> Decoded:
    dec = bf.Decoder(max_entry=max_entry, max_body=max_body)
    entries = dec.feed(body)
    dec.finish()
    while len(_batches) >= MAX_BATCHES:  # ones the gateway gave up on without a word (it was killed meanwhile)
        del _batches[next(iter(_batches))]
    _batches[batch] = entries
    scrapes = sum(isinstance(e, bf.Scrape) for e in entries)
    return Decoded(os.getpid(), scrapes, list(dict.fromkeys(e.node for e in entries)))


def _step(batch: int, builder: Builder) -> Step:
    start = time.thread_time()
    request = builder.next()
    if request is None:
        _batches.pop(batch, None)
    return Step(request, time.thread_time() - start, dict(builder.dropped), builder.last_seq)


def _build(batch: int, settings: BuildSettings, pools: dict[str, str], now_ms: int) -> Step:
    entries = _batches.get(batch)
    if not isinstance(entries, list):
        raise WorkerLost(f"batch {batch} is not held by worker process {os.getpid()}")
    builder = _batches[batch] = Builder(entries, settings, pools.get, now_ms, _series)
    return _step(batch, builder)


def _next(batch: int) -> Step:
    builder = _batches.get(batch)
    if not isinstance(builder, Builder):
        raise WorkerLost(f"batch {batch} is not being built by worker process {os.getpid()}")
    return _step(batch, builder)


def _forget(batch: int) -> None:
    _batches.pop(batch, None)


# ---------------------------------------------------------------- in the gateway


def _ended(process: BaseProcess | None) -> str:
    code = None if process is None else process.exitcode
    if code is None:
        return "the worker process ended"
    if code < 0:
        try:
            return f"the worker process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the worker process was killed by signal {-code}"
    return f"the worker process exited with status {code}"


def _exits(process: BaseProcess, within: float) -> bool:
    """Whether the process ends within ``within`` seconds (without reaping it: its executor does)."""
    return bool(multiprocessing.connection.wait([process.sentinel], within))


class CatchupWorker:
    """The gateway's handle on the worker process: started at the first call, replaced after it is lost,
    stopped by :meth:`close`."""

    def __init__(self, deadline: float, niceness: int = NICENESS) -> None:
        self.deadline = deadline
        self.niceness = niceness
        self.generation = 0  # worker processes lost so far (the batches a lost one held are lost with it)
        self._pool: ProcessPoolExecutor | None = None
        self._process: BaseProcess | None = None
        self._ready = False  # the worker answered a call (it has started)
        self._ids = itertools.count(1)
        self._closed = False
        self._turn = asyncio.Lock()  # one call in the worker at a time
        self._orphan: tuple[ProcessPoolExecutor, Future[Any], float] | None = None  # a step its caller gave up on

    @property
    def pid(self) -> int | None:
        """The worker process's, while there is one."""
        return None if self._process is None else self._process.pid

    def batch(self) -> Batch:
        return Batch(self, next(self._ids), self.generation)

    async def call(self, fn: Callable[..., T], *args: Any, generation: int | None = None) -> T:
        """``fn(*args)`` in the worker, within the deadline; raise :class:`WorkerLost` when the worker is lost
        (killed past the deadline, or dead), was replaced since ``generation`` (the one the batch was given to), or
        the gateway is stopping.

        One call at a time is in the worker: the deadline starts at the call's turn (the lock), so that it measures
        the call's own run, not its wait behind the other sessions' batches."""
        async with self._turn:
            if self._closed:
                raise WorkerLost("the gateway is stopping")
            await self._settle()
            if generation is not None and generation != self.generation:
                raise WorkerLost(LOST_MEANWHILE)
            return await self._run(fn, args)

    async def _run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        pool = self._pool
        if pool is None:
            pool = self._pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), initializer=_init,
                                                    initargs=(self.niceness,))
            self._ready = False
        deadline = self.deadline if self._ready else self.deadline + START_TIME
        try:
            fut = pool.submit(fn, *args)
        except BrokenProcessPool:
            raise self._lost(pool, _ended(self._process)) from None
        if self._process is None:  # started by this first submit
            self._process = next(iter(pool._processes.values()), None)  # no public handle before 3.14
        until = asyncio.get_running_loop().time() + deadline
        try:
            async with asyncio.timeout_at(until):
                got = await asyncio.wrap_future(fut)
            self._ready = self._ready or pool is self._pool
            return got
        except TimeoutError:
            raise self._lost(pool, f"a step of the build took longer than {self.deadline:g} s (build_timeout): "
                             "the worker process was killed", kill=True) from None
        except BrokenProcessPool:
            raise self._lost(pool, _ended(self._process)) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if fut.cancelled() and task is not None and not task.cancelling():  # not this caller's: the pool's
                raise WorkerLost("the gateway is stopping" if self._closed else LOST_MEANWHILE) from None
            if not fut.done():  # the caller gave up on it (its session ended): the step still has its turn
                self._orphan = (pool, fut, until)
            raise

    async def _settle(self) -> None:
        """Before the next call: the step a caller gave up on ends, or is killed at its own deadline."""
        if self._orphan is None:
            return
        pool, fut, until = self._orphan
        if pool is self._pool and not fut.done():
            await asyncio.wait([asyncio.wrap_future(fut)], timeout=max(0.0, until - asyncio.get_running_loop().time()))
            if pool is self._pool and not fut.done():
                why = (f"a step of a batch whose session ended took longer than {self.deadline:g} s (build_timeout): "
                       "the worker process was killed")
                log.warning("catch-up worker: %s", self._lost(pool, why, kill=True))
        self._orphan = None

    def forget(self, batch: int, generation: int) -> None:
        """The worker may drop the batch (without waiting for it to)."""
        pool = self._pool
        if pool is not None and generation == self.generation:
            try:
                pool.submit(_forget, batch)
            except (BrokenProcessPool, RuntimeError):
                pass  # lost or stopping: the batch went with it

    def _lost(self, pool: ProcessPoolExecutor, why: str, kill: bool = False) -> WorkerLost:
        if pool is self._pool:
            if kill and self._process is not None:
                self._process.kill()
            self._pool, self._process = None, None
            self.generation += 1
            pool.shutdown(wait=False, cancel_futures=True)
        return WorkerLost(f"{why}; the batch is asked for again")

    async def close(self) -> None:
        """Stop the worker: it ends when its step is done, or is killed after :data:`STOP_GRACE`."""
        self._closed = True
        pool, process = self._pool, self._process
        self._pool, self._process = None, None
        if pool is None:
            return
        pool.shutdown(wait=False, cancel_futures=True)
        if process is not None:
            if not await asyncio.to_thread(_exits, process, STOP_GRACE):
                process.kill()


class Batch:
    """One batch in the worker: :meth:`decode`, then :meth:`build` and :meth:`next` until a step has no request;
    :meth:`close` always (the worker forgets it)."""

    def __init__(self, worker: CatchupWorker, ident: int, generation: int) -> None:
        self.worker = worker
        self.ident = ident
        self.generation = generation
        self.done = False  # the worker forgot it itself

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.worker.call(fn, self.ident, *args, generation=self.generation)

    async def decode(self, body: bytes, max_entry: int, max_body: int) -> Decoded:
        """The batch's entries (raise bf.BackfillError when the body does not decode)."""
        return await self._call(_decode, body, max_entry, max_body)

    async def build(self, settings: BuildSettings, pools: dict[str, str], now_ms: int) -> Step:
        """The first step: the batch checked against ``pools`` (node -> pool, the session's own) and now."""
        return self._stepped(await self._call(_build, settings, pools, now_ms))

    async def next(self) -> Step:
        return self._stepped(await self._call(_next))

    def _stepped(self, step: Step) -> Step:
        self.done = step.request is None
        return step

    def close(self) -> None:
        if not self.done:
            self.worker.forget(self.ident, self.generation)
