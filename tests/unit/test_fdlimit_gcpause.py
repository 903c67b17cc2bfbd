"""The start-up open-files check (raven/ops/fdlimit.py) and the collector's pauses (raven/ops/gcpause.py).

Both change process-wide state (the descriptor limit; gc callbacks, thresholds and the frozen set), so each case
runs in a child process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families


def run_child(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return out.stderr + out.stdout  # the JSON a case prints last stays the last line, whatever was logged


def test_a_configuration_that_needs_more_descriptors_than_the_limit_says_so_with_the_numbers() -> None:
    out = run_child(
        "import logging, resource\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))\n"
        "from raven.ops.fdlimit import check_descriptors\n"
        "c = check_descriptors('agent', {'upstream_max_connections': 4096, 'the ops listener': 512})\n"
        "print('RESULT', c.enough, c.limit, c.needs, c.available(512 + 256))\n"
        "c = check_descriptors('agent', {'upstream_max_connections': 100})\n"
        "print('RESULT', c.enough, c.limit, c.needs)\n"
    )
    results = [line.split()[1:] for line in out.splitlines() if line.startswith("RESULT")]
    assert results == [["False", "300", "4608", "64"], ["True", "300", "100"]], out
    warnings = [line for line in out.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, out
    assert ("this agent configuration needs 4608 open files (4096 upstream_max_connections + 512 the ops listener), "
            "and RLIMIT_NOFILE is 300: raise it to at least 4608") in warnings[0]
    assert "INFO open files: this agent configuration needs 100, RLIMIT_NOFILE is 300" in out


def test_the_soft_limit_is_raised_to_the_hard_one_before_the_check() -> None:
    out = run_child(
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "from raven.ops.fdlimit import check_descriptors\n"
        "c = check_descriptors('gateway', {'front.max_connections': 100})\n"
        "print('RESULT', c.limit == hard or hard == resource.RLIM_INFINITY, c.enough)\n"
    )
    assert "RESULT True True" in out, out


def test_collections_are_timed_exported_and_settling_freezes_the_survivors() -> None:
    out = run_child(
        "import asyncio, gc, json\n"
        "from prometheus_client import generate_latest\n"
        "from raven.ops import gcpause\n"
        "from raven.ops.metrics import AgentMetrics, GatewayMetrics\n"
        "gcpause.install(); gcpause.install()\n"
        "keep = [[i] for i in range(100_000)]\n"
        "gc.collect()\n"
        "gc.collect(0)\n"
        "async def main():\n"
        "    gcpause.SETTLE_QUIET = 0.01\n"
        "    gcpause.SETTLE_MIN_INTERVAL = 0\n"
        "    gcpause.settle_soon(); gcpause.settle_soon()\n"
        "    while gcpause.settles() == 0:\n"
        "        await asyncio.sleep(0.01)\n"
        "    gcpause.stop_settling()\n"
        "asyncio.run(main())\n"
        "print(json.dumps({'callbacks': gc.callbacks.count(gcpause.PAUSES.callback), 'threshold': gc.get_threshold(),\n"
        "    'frozen': gc.get_freeze_count(), 'settles': gcpause.settles(),\n"
        "    'agent': generate_latest(AgentMetrics().registry).decode(),\n"
        "    'gateway': generate_latest(GatewayMetrics().registry).decode()}))\n"
    )
    data = json.loads(out.splitlines()[-1])
    assert data["callbacks"] == 1  # installed once, however often asked
    assert tuple(data["threshold"]) == (10_000, 10, 10)
    assert data["settles"] == 1  # two changes in a row settle once
    assert data["frozen"] >= 100_000  # the long-lived list survived the settle's collection and was frozen
    for page in (data["agent"], data["gateway"]):
        samples = {(s.name, s.labels.get("generation"), s.labels.get("le")): s.value
                   for f in text_string_to_metric_families(page) for s in f.samples}
        full = samples[("raven_gc_pause_seconds_count", "2", None)]
        assert full >= 2  # the explicit collection and the settle's
        assert samples[("raven_gc_pause_seconds_bucket", "2", "+Inf")] == full
        assert samples[("raven_gc_pause_seconds_count", "0", None)] >= 1
        assert samples[("raven_gc_pause_max_seconds", "2", None)] > 0
        assert samples[("raven_gc_pause_seconds_sum", "2", None)] >= samples[("raven_gc_pause_max_seconds", "2", None)]
        assert samples[("raven_gc_frozen_objects", None, None)] >= 100_000
        assert samples[("raven_gc_settles_total", None, None)] == 1


def test_later_settles_freeze_new_long_lived_objects_without_a_full_collection() -> None:
    # The first settle walks everything; the next ones collect the young generations and freeze the rest as
    # it is: a full collection of 10,000 keep-alive connections' objects stalled the gateway for 300-900 ms.
    out = run_child(
        "import asyncio, gc, json\n"
        "from raven.ops import gcpause\n"
        "gcpause.install()\n"
        "async def main():\n"
        "    gcpause.SETTLE_QUIET = 0.01\n"
        "    gcpause.SETTLE_MIN_INTERVAL = 0\n"
        "    gcpause.settle_soon()\n"
        "    while gcpause.settles() < 1:\n"
        "        await asyncio.sleep(0.01)\n"
        "    frozen = gc.get_freeze_count()\n"
        "    keep = [[i] for i in range(100_000)]\n"
        "    gc.collect(1)\n"  # the new objects are old now (generation 2), as connections held a while are
        "    full = sum(gcpause.PAUSES.buckets[2])\n"
        "    gcpause.settle_soon()\n"
        "    while gcpause.settles() < 2:\n"
        "        await asyncio.sleep(0.01)\n"
        "    gcpause.stop_settling()\n"
        "    print(json.dumps({'frozen': gc.get_freeze_count() - frozen, 'kept': len(keep),\n"
        "        'full_during_second': sum(gcpause.PAUSES.buckets[2]) - full, 'walks': gcpause.full_walks()}))\n"
        "asyncio.run(main())\n"
    )
    data = json.loads(out.splitlines()[-1])
    assert data["frozen"] >= 100_000  # the new long-lived objects were frozen by the second settle
    assert data["full_during_second"] == 0  # without walking them (nor the frozen set) in a full collection
    assert data["walks"] == 1  # only the first settle walked everything


def test_the_start_up_settle_walks_everything_at_once_and_later_settles_do_not() -> None:
    # A service calls settle_at_start before it opens a port or a session: the one full walk is done there, in
    # line, so that it does not fall on the first packets and requests a few seconds later (it held a new layer-3
    # agent's first pings 250-350 ms on a busy machine).
    out = run_child(
        "import asyncio, gc, json\n"
        "from raven.ops import gcpause\n"
        "keep = [[i] for i in range(50_000)]\n"
        "async def main():\n"
        "    gcpause.SETTLE_QUIET = 0.01\n"
        "    gcpause.SETTLE_MIN_INTERVAL = 0\n"
        "    gcpause.settle_at_start()\n"
        "    at_start = {'settles': gcpause.settles(), 'walks': gcpause.full_walks(),\n"
        "                'frozen': gc.get_freeze_count(), 'callback': gcpause.PAUSES.callback in gc.callbacks}\n"
        "    more = [[i] for i in range(50_000)]\n"
        "    gcpause.settle_soon()\n"
        "    while gcpause.settles() < 2:\n"
        "        await asyncio.sleep(0.01)\n"
        "    gcpause.stop_settling()\n"
        "    print(json.dumps({**at_start, 'walks_after': gcpause.full_walks(), 'kept': len(keep) + len(more)}))\n"
        "asyncio.run(main())\n"
    )
    data = json.loads(out.splitlines()[-1])
    assert data["callback"] is True  # installed (timing) too
    assert (data["settles"], data["walks"]) == (1, 1)  # done before settle_at_start returned, with the full walk
    assert data["frozen"] >= 50_000
    assert data["walks_after"] == 1  # the next settle froze the new objects without walking everything again


def test_settling_is_not_postponed_forever_by_changes_that_go_on() -> None:
    # A steady trickle of changes (connections opening one by one) must not keep the new state unfrozen.
    out = run_child(
        "import asyncio, json\n"
        "from raven.ops import gcpause\n"
        "gcpause.install()\n"
        "async def main():\n"
        "    gcpause.SETTLE_QUIET = 0.5\n"
        "    gcpause.SETTLE_MIN_INTERVAL = 0\n"
        "    gcpause.SETTLE_MAX_WAIT = 0.2\n"
        "    for _ in range(400):\n"  # a change every 10 ms, never 0.5 s of quiet, for at most 4 s
        "        gcpause.settle_soon()\n"
        "        if gcpause.settles():\n"
        "            break\n"
        "        await asyncio.sleep(0.01)\n"
        "    gcpause.stop_settling()\n"
        "    print(json.dumps({'settles': gcpause.settles()}))\n"
        "asyncio.run(main())\n"
    )
    assert json.loads(out.splitlines()[-1])["settles"] >= 1, out


def test_a_full_walk_frees_cyclic_garbage_among_frozen_objects_and_counts_it() -> None:
    # Frozen objects that die in a cycle wait for the next full walk (a day by default); the walk frees them
    # and says how many there were.
    out = run_child(
        "import asyncio, gc, json\n"
        "from raven.ops import gcpause\n"
        "gcpause.install()\n"
        "class Node:\n"
        "    def __init__(self) -> None:\n"
        "        self.me = self\n"
        "async def main():\n"
        "    gcpause.SETTLE_QUIET = 0.01\n"
        "    gcpause.SETTLE_MIN_INTERVAL = 0\n"
        "    cycles = [Node() for _ in range(5_000)]\n"
        "    gcpause.settle_soon()\n"
        "    while gcpause.settles() < 1:\n"  # the first settle walks, then freezes the cycles
        "        await asyncio.sleep(0.01)\n"
        "    frozen_with = gc.get_freeze_count()\n"
        "    del cycles[:]\n"  # now garbage, kept by their cycles, frozen
        "    gcpause.SETTLE_FULL_INTERVAL = 0\n"
        "    gcpause.settle_soon()\n"
        "    while gcpause.settles() < 2:\n"
        "        await asyncio.sleep(0.01)\n"
        "    gcpause.stop_settling()\n"
        "    print(json.dumps({'walks': gcpause.full_walks(), 'garbage': gcpause._SETTLER.garbage,\n"
        "        'frozen_drop': frozen_with - gc.get_freeze_count()}))\n"
        "asyncio.run(main())\n"
    )
    data = json.loads(out.splitlines()[-1])
    assert data["walks"] == 2
    assert data["garbage"] >= 5_000  # the 5,000 frozen cycles (and their dicts) were found and freed
    assert data["frozen_drop"] >= 5_000



def test_reading_the_metrics_and_settling_never_count_the_frozen_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # gc.get_freeze_count() walks every frozen object holding the interpreter lock (30-60 ms with 10,000
    # connections): called for every read of /metrics, it made each read a stall of the data path.
    import asyncio
    import gc

    from prometheus_client import CollectorRegistry, generate_latest

    from raven.ops import gcpause

    def walk() -> int:
        raise AssertionError("gc.get_freeze_count() walks the whole frozen set")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    monkeypatch.setattr(gcpause, "SETTLE_QUIET", 0.0)
    monkeypatch.setattr(gcpause, "SETTLE_MIN_INTERVAL", 0.0)
    registry = CollectorRegistry()
    registry.register(gcpause.GcCollector())

    async def settle_twice() -> None:
        settler = gcpause._Settler()  # its own, so the process's settler is left as it is
        try:
            for _ in range(2):  # a full walk, then a young collection
                settler.soon()
                before = settler.settles
                for _ in range(200):
                    if settler.settles > before:
                        break
                    await asyncio.sleep(0.01)
            assert settler.settles == 2 and settler.full_walks == 1 and settler.frozen > 0
        finally:
            settler.stop()
            gc.unfreeze()  # the test process's objects go back to the collector

    asyncio.run(settle_twice())
    assert b"raven_gc_frozen_objects" in generate_latest(registry)
