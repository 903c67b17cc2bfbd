"""Garbage-collector pauses: measured, exported, and kept short.

A service holds many long-lived objects (sessions, the registry or the inventory, connections, metrics) and
CPython's full (generation-2) collection walks every one of them, in one go, on the event loop: with a fleet
that was tens of milliseconds every couple of minutes, in every process at once. What this module does:

* :func:`install` (once per process, whatever number of services it runs) times every collection with
  ``gc.callbacks`` and raises the young-generation threshold, so that a busy data path triggers fewer, still
  small, collections (``GC_THRESHOLDS``).
* :func:`settle_at_start` runs the first settle (the full walk, below) at once, before a service opens a port or
  a session, so that its pause falls on no traffic.
* :func:`settle_soon` is called when the long-lived state changed (the rest of start-up, a registration, an inventory
  change, a session up or down, the front end's connections or an agent's connections to nodes grew by a
  step: ``on_grown`` of ConnectionGuard and of agent/upstream.py's UpstreamPool). Once that has been quiet for
  ``SETTLE_QUIET`` seconds (at most once per ``SETTLE_MIN_INTERVAL``, and no later than ``SETTLE_MAX_WAIT``
  after the first change even if changes go on), everything alive is frozen (``gc.freeze()``): automatic
  collections no longer walk it. A settle collects only the youngest generation first (0: at most
  ``GC_THRESHOLDS[0]`` new objects, a few milliseconds) and freezes the rest as it is, without walking it.
  Settles follow a growth closely (seconds, not tens of seconds): while 10,000 connections open (a gateway's
  start, Prometheus reconnecting after a restart) their objects pile up in the young generations, and every
  generation-1 collection walked all that had piled up since the last one, 100-130 ms of CPU every 3-6 s
  during the ramp; and a settle that collected generation 1 too paid that once more. A full collection walks
  every live object,
  and with 10,000 keep-alive connections (about 30 tracked objects each) that was a 300-900 ms stall of the
  whole process, once per settle. Objects frozen that die later are still freed by their reference counts (a
  closed connection's objects are: none of them is left to a collection); only cyclic garbage among frozen
  objects waits for the next full walk: the first settle and then one every ``SETTLE_FULL_INTERVAL`` (a day)
  thaw everything and run one full collection (one pause as long as a full collection of the live state: about
  300 ms with 10,000 keep-alive connections; logged with the number of unreachable objects it found). What can
  wait for it is small: only objects that were alive when a settle froze them (the requests in flight at that
  moment) and died in a cycle since, so a day's worth of it is bounded by the settles of a day (at least one every
  ``SETTLE_MAX_INTERVAL``) times a few requests' objects; the log line shows what it was.
* :class:`GcCollector` exports ``raven_gc_pause_seconds{generation}`` (a histogram),
  ``raven_gc_pause_max_seconds{generation}`` (the longest pause since the process started),
  ``raven_gc_frozen_objects`` and ``raven_gc_settles_total`` into a service's registry; the settles' own
  collections count too.
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("raven.gc")

GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# CPython's default is (700, 10, 10): a young collection every 700 net allocations. 10,000 makes them 14 times
# rarer under load and each still takes about a millisecond; a full collection is considered every 1,000,000
# net allocations (and, as always, only when the objects that survived since the last one are a quarter of
# those it would walk).
GC_THRESHOLDS = (10_000, 10, 10)
SLOW_PAUSE = 0.1  # a collection this long (wall time) is logged, with its CPU time
SETTLE_QUIET = 1.0  # seconds without a change before settling
SETTLE_MIN_INTERVAL = 1.0  # between two settles (each is a generation-0 collection and a freeze: milliseconds)
SETTLE_MAX_WAIT = 2.0  # a settle no later than this after the first change, even if changes go on (a ramp)
SETTLE_MAX_INTERVAL = 900.0  # a settle at least this often (the state may change without a notice)
# A full walk (thaw, collect everything, freeze) at least this often. Hourly was one stall of ~300 ms an hour with
# 10,000 connections, to free what the log line shows is next to nothing (see the module's docstring).
SETTLE_FULL_INTERVAL = 86_400.0


class GcPauses:
    """The process's collections, timed: counts per bucket, sum and maximum, per generation."""

    def __init__(self) -> None:
        self._started = 0.0
        self._started_cpu = 0.0
        self.buckets = [[0] * (len(GC_BUCKETS) + 1) for _ in range(3)]  # the last one is +Inf
        self.sums = [0.0, 0.0, 0.0]
        self.max = [0.0, 0.0, 0.0]

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self._started_cpu = time.thread_time()
            return
        pause = time.perf_counter() - self._started
        gen = min(2, max(0, int(info.get("generation", 2))))
        self.buckets[gen][bisect.bisect_left(GC_BUCKETS, pause)] += 1
        self.sums[gen] += pause
        if pause > self.max[gen]:
            self.max[gen] = pause
        if pause >= SLOW_PAUSE:
            # Wall time and the thread's CPU time: a pause with little CPU in it was the process waiting for a
            # core (a busy machine), one with as much CPU was the collection's own work.
            log.warning("gc: a generation-%d collection held the process %.0f ms (%.0f ms of CPU): %d objects "
                        "collected, %d frozen", gen, pause * 1000, (time.thread_time() - self._started_cpu) * 1000,
                        int(info.get("collected", 0)), _SETTLER.frozen)


class _Settler:
    def __init__(self) -> None:
        self.handle: asyncio.TimerHandle | None = None
        self.last = time.monotonic() - SETTLE_MIN_INTERVAL
        self.thawed = self.last - SETTLE_FULL_INTERVAL  # the first settle walks everything
        self.pending_since: float | None = None  # the first change not settled yet
        self.settles = 0
        self.full_walks = 0
        self.garbage = 0  # unreachable objects the last full walk found
        # Objects frozen: counted at the last full walk, plus what each settle since added (those of them freed
        # since are not taken off: gc.get_freeze_count() walks every frozen object, 30-60 ms with 10,000
        # connections' objects, holding the interpreter lock: it made every read of /metrics a stall).
        self.frozen = 0

    def soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self.handle is not None:
            self.handle.cancel()
        now = time.monotonic()
        if self.pending_since is None:
            self.pending_since = now
        delay = max(SETTLE_QUIET, self.last + SETTLE_MIN_INTERVAL - now)
        delay = min(delay, max(0.0, self.pending_since + SETTLE_MAX_WAIT - now))
        self.handle = loop.call_later(delay, self.settle)

    def settle(self) -> None:
        """Collect the youngest generation and freeze everything alive; every ``SETTLE_FULL_INTERVAL`` (and the
        first time) thaw and collect everything first, so that cyclic garbage among frozen objects goes."""
        self.handle = None
        self.pending_since = None
        started = time.perf_counter()
        full = time.monotonic() - self.thawed >= SETTLE_FULL_INTERVAL
        garbage = 0
        if full:
            gc.unfreeze()
            garbage = gc.collect()
            self.thawed = time.monotonic()
            self.full_walks += 1
            self.garbage = garbage
        else:
            gc.collect(0)
        # What is about to be frozen: every unfrozen object (generation 0 is empty now); after a full walk that
        # is all of them, after a young collection only what came since the last settle.
        added = len(gc.get_objects(1)) + len(gc.get_objects(2))
        gc.freeze()
        self.frozen = added if full else self.frozen + added
        self.last = time.monotonic()
        self.settles += 1
        took = (time.perf_counter() - started) * 1000
        if full:
            log.info("gc settled with a full walk in %.1f ms: %d unreachable objects freed, %d objects frozen",
                     took, garbage, self.frozen)
        else:
            log.debug("gc settled in %.1f ms: %d objects frozen (%d new)", took, self.frozen, added)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.handle = loop.call_later(SETTLE_MAX_INTERVAL, self.settle)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


PAUSES = GcPauses()
_SETTLER = _Settler()


def tuning_enabled() -> bool:
    """``RAVEN_GC_TUNING=off`` keeps CPython's defaults (pauses are still timed): to compare, or to rule it out."""
    return os.environ.get("RAVEN_GC_TUNING", "on").lower() not in ("off", "0", "false", "no")


def install() -> None:
    """Time every collection and raise the young threshold; idempotent (several services, one process)."""
    if PAUSES.callback not in gc.callbacks:
        gc.callbacks.append(PAUSES.callback)
        if tuning_enabled():
            gc.set_threshold(*GC_THRESHOLDS)


def settle_at_start() -> None:
    """Install, then settle at once with the full walk, before the service opens a port or a session.

    The first settle walks everything alive (about 120,000 objects once the modules are imported: 100-130 ms of
    CPU, 250-350 ms of wall time on a busy machine). Done later, as a settle after the first session or
    connections, that pause fell on the first packets and requests the new process carried: a restarted agent or
    gateway held its first layer-3 packets and scrapes that long. Done here, nothing waits on it; the next
    settles collect only the young generation. Without ``RAVEN_GC_TUNING`` it only installs the timing."""
    install()
    if tuning_enabled():
        _SETTLER.stop()  # a pending settle's timer (another service of this process) is replaced, not orphaned
        _SETTLER.settle()
        _SETTLER.soon()  # and what the rest of the start-up makes is frozen once it is quiet (young only)


def settle_soon() -> None:
    """The long-lived state changed: settle (collect, then freeze) once it has been quiet for a while.

    Call it from the event loop; without a running loop (or with ``RAVEN_GC_TUNING=off``) it does nothing."""
    if tuning_enabled():
        _SETTLER.soon()


def stop_settling() -> None:
    """Cancel a pending settle (a service stops; the loop is about to close)."""
    _SETTLER.stop()


def settles() -> int:
    """How many settles ran in this process (for tests and the log)."""
    return _SETTLER.settles


def full_walks() -> int:
    """How many settles thawed and walked everything (for tests)."""
    return _SETTLER.full_walks


class GcCollector(Collector):
    """Exports the process's collection pauses into one service's registry."""

    def __init__(self, pauses: GcPauses = PAUSES) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[Metric]:
        p = self.pauses
        hist = HistogramMetricFamily(
            "raven_gc_pause_seconds", "Garbage-collector pauses of this process, by generation (2: full)",
            labels=["generation"],
        )
        longest = GaugeMetricFamily(
            "raven_gc_pause_max_seconds", "The longest garbage-collector pause of this process since it started",
            labels=["generation"],
        )
        for gen in range(3):
            counts = p.buckets[gen]
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for le, n in zip((*map(str, GC_BUCKETS), "+Inf"), counts, strict=True):
                cumulative += n
                buckets.append((le, cumulative))
            hist.add_metric([str(gen)], buckets, p.sums[gen])
            longest.add_metric([str(gen)], p.max[gen])
        yield hist
        yield longest
        yield GaugeMetricFamily("raven_gc_frozen_objects", "Objects kept out of the collector's way (gc.freeze): "
                                "counted at the last full walk plus those later settles added (frozen objects "
                                "freed since are not subtracted: counting them would walk them all)",
                                value=_SETTLER.frozen)
        yield CounterMetricFamily("raven_gc_settles", "Settles (young collection, then freeze) of this process",
                                  value=_SETTLER.settles)
