"""The status made from set operations over a kept summary of the node views (status.Fleet), so that a status read at
fleet size walks no node in Python (issue 34: the page answers in milliseconds and holds the interpreter lock, which
the event loop needs, for as little): every count, pool row and page is what the per-node definition of the states
says, for random fleets, filters and pages; a status made with the summary kept does not walk the node views."""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from gateway import status, views
from gateway.nodeview import NodeView, RefusedClaim
from tests.support.fleetviews import failing_of, fake_gateway, fleet, inp_of

CODES = ("200", "304", "502", "504", "broken-502", "client-gone")


def state_of(v: NodeView, last: Mapping[str, status.NodeResult]) -> str:
    """The states as the status documents them, one node at a time (the oracle)."""
    result = last.get(v.name)
    if result is not None and not status.succeeded(result.code):
        return "failing"
    return "unreachable" if not v.agents else "idle" if result is None else "ok"


def expected(inp: status.StatusInput, query: status.StatusQuery) -> tuple[dict[str, int], list[str], dict[str, Any]]:
    """(counts per state, the page's names, per pool (nodes, reachable, failing, last error's node))."""
    def wanted(pool: str, name: str) -> bool:
        return not ((query.pools and pool not in query.pools) or (query.q and query.q not in name.lower()))

    listed: dict[str, list[str]] = {s: [] for s in status.STATES}
    pools: dict[str, list[Any]] = {}
    for v in inp.views.values():
        state = state_of(v, inp.last)
        row = pools.setdefault(v.pool, [0, 0, 0, None])
        row[0] += 1
        row[1] += bool(v.agents)
        if state == "failing":
            row[2] += 1
            if row[3] is None or inp.last[v.name].at > inp.last[row[3]].at:
                row[3] = v.name
        if wanted(v.pool, v.name):
            listed[state].append(v.name)
    listed["refused"] = [c.name for c in inp.refused.values() if wanted(c.pool, c.name)]
    order = [n for s in status.STATES if not query.states or s in query.states for n in sorted(listed[s])]
    counts = {s: len(listed[s]) for s in status.STATES}
    return counts, order[query.offset:query.offset + query.limit], {p: tuple(r) for p, r in pools.items()}


def random_input(rng: random.Random) -> status.StatusInput:
    now = time.time()
    names = rng.sample([f"n-{k}" for k in range(2000)], rng.randrange(0, 1200))
    node_views: dict[str, NodeView] = {}
    last: dict[str, status.NodeResult] = {}
    for name in names:
        agents = () if rng.random() < 0.2 else ("agent-a",) if rng.random() < 0.8 else ("agent-a", "agent-b")
        node_views[name] = NodeView(name, f"pool-{rng.randrange(4)}", "10.0.0.1", agents, None)
        if rng.random() < 0.85:
            last[name] = status.NodeResult(now - rng.random() * 60, rng.choice(CODES), "why")
    refused = {f"r-{k}": RefusedClaim(f"r-{k}", f"pool-{rng.randrange(5)}", "agent-a", "not yours", now)
               for k in range(rng.randrange(0, 5))}
    return status.StatusInput("gw", 1, now - 10, (True, "ok"), False, node_views, last, [], None, refused,
                              failing=failing_of(last) if rng.random() < 0.5 else None)


def random_query(rng: random.Random) -> status.StatusQuery:
    return status.StatusQuery(
        frozenset(rng.sample([f"pool-{k}" for k in range(6)], rng.randrange(0, 3))),
        rng.choice(["", "", "n-1", "-19", "zz"]),
        frozenset(rng.sample(status.STATES, rng.randrange(0, 3))),
        rng.choice([1, 7, 50, 1000]), rng.choice([0, 0, 3, 100, 700, 5000]))


def test_counts_pool_rows_and_pages_are_what_each_nodes_state_says() -> None:
    rng = random.Random(34)
    for _ in range(150):
        inp = random_input(rng)
        fleet_summary = status.fleet_of(inp.views, inp.pools)
        for _ in range(6):
            query = random_query(rng)
            snap = status.build(inp, query, fleet_summary)
            counts, page, pools = expected(inp, query)
            assert snap["states"] == counts, query
            assert snap["matched"] == sum(counts[s] for s in status.STATES if not query.states or s in query.states)
            assert [n["name"] for n in snap["nodes"]] == page, query
            got = {p["pool"]: (p["nodes"], p["reachable"], p["failing"],
                               p["last_error"]["node"] if p["last_error"] else None) for p in snap["pools"]}
            assert {p: got[p] for p in pools} == pools
            for n in snap["nodes"]:
                if n["state"] != "refused":
                    assert n["state"] == state_of(inp.views[n["name"]], inp.last)


class Untouchable(dict[str, NodeView]):
    """Node views that fail a walk: only single lookups are allowed."""

    def values(self) -> Any:
        raise AssertionError("the status walked every node view")

    def items(self) -> Any:
        raise AssertionError("the status walked every node view")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("the status walked every node view")


def test_a_status_with_the_fleet_summary_kept_walks_no_node_at_10000_nodes() -> None:
    reg, pools, last, _ = fleet(Path(tempfile.mkdtemp(prefix="raven-status-")))
    inp = inp_of(reg, pools, last)
    inp.failing = failing_of(last)
    summary = status.fleet_of(inp.views, inp.pools)
    whole = status.build(inp, status.StatusQuery())
    inp.views = Untouchable(inp.views)
    every = {"failing": 30, "unreachable": 1000, "refused": 2, "idle": 0, "ok": 8970, "direct": 0}
    pool_3 = {"failing": 30, "unreachable": 0, "refused": 0, "idle": 0, "ok": 970, "direct": 0}
    for query, counts in ((status.StatusQuery(), every), (status.StatusQuery(offset=5000), every),
                          (status.StatusQuery(frozenset({"pool-3"}), "gpu"), pool_3)):
        assert status.build(inp, query, summary)["states"] == counts
    assert status.build(inp, status.StatusQuery(), summary)["nodes"] == whole["nodes"]


async def test_the_views_keep_the_fleet_summary_until_a_registration_changes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reg, pools, last, gone = fleet(Path(tempfile.mkdtemp(prefix="raven-status-")))
    v = views.Views(fake_gateway(reg, pools, last))
    made: list[int] = []
    real = status.fleet_of

    def counted(*args: Any) -> status.Fleet:
        made.append(1)
        return real(*args)

    monkeypatch.setattr(status, "fleet_of", counted)
    for _ in range(3):
        v.status_pages.clear()
        page = await v.status_page(status.StatusQuery(), html=False)
    assert len(made) == 1 and b'"unreachable":1000' in page.body
    reg.add_session(gone)  # pool-9's agent is back: its 1,000 nodes are reachable again
    reg.register(gone, list(gone.last_register))
    v.status_pages.clear()
    page = await v.status_page(status.StatusQuery(), html=False)
    assert len(made) == 2 and b'"unreachable":0' in page.body
