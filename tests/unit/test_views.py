"""The views at fleet size (issue 34): the status opens on a summary and the nodes that need attention, filtered and
paged, small at 10,000 nodes; /sd grouped; the registry's node views rebuilt only where something changed; every
view rendered in a worker thread while the event loop keeps running, and kept while nothing changed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gateway import discovery, status, views
from gateway.registry import MAX_REFUSED_KEPT
from gateway.statuspage import render_html, render_text
from raven.protocol import wire
from tests.support.fleetviews import PER_POOL, POOLS, agent, fake_gateway, fleet, inp_of
from tests.support.loopticks import loop_ticks


def test_the_default_status_at_10000_nodes_is_a_summary_and_the_nodes_that_need_attention(tmp_path: Path) -> None:
    reg, pools, last, _ = fleet(tmp_path)
    inp = inp_of(reg, pools, last)
    started = time.perf_counter()
    snap = status.build(inp)
    page = render_html(snap).encode()
    took = time.perf_counter() - started
    print(f"default page at 10,000 nodes: {len(page)} bytes, built and drawn in {took * 1000:.1f} ms")
    assert len(page) <= 100 * 1024, len(page)  # the whole fleet's page was 1.17 MB
    assert snap["states"] == {"failing": 30, "unreachable": 1000, "refused": 2, "idle": 0, "ok": 8970, "direct": 0}
    assert snap["matched"] == 10_002 and len(snap["nodes"]) == status.DEFAULT_LIMIT
    # Attention first: the failing (by name), then the unreachable; the rest is a count and a link.
    assert [n["state"] for n in snap["nodes"]] == ["failing"] * 30 + ["unreachable"] * 20
    assert [n["name"] for n in snap["nodes"][:3]] == ["edge-gpu-3-0", "edge-gpu-3-1", "edge-gpu-3-10"]
    by_pool = {p["pool"]: p for p in snap["pools"]}
    assert by_pool["pool-3"]["failing"] == 30 and by_pool["pool-3"]["last_error"]["node"] == "edge-gpu-3-29"
    assert "cannot connect to node edge-gpu-3-29" in by_pool["pool-3"]["last_error"]["reason"]
    assert (by_pool["pool-9"]["reachable"], by_pool["pool-9"]["nodes"], by_pool["pool-9"]["agents"]) == (0, 1000, [])
    assert by_pool["pool-0"]["agents"][0]["agent"] == "agent-0" and by_pool["pool-0"]["reachable"] == 1000
    assert by_pool["pool-0"]["refused"] == 1  # a refused claim shows under the pool it asked for...
    assert "pool-y" not in by_pool  # ... without a row for a pool that no node is in
    text = page.decode()
    assert "9952 more" in text and "offset=50" in text and "edge-gpu-3-29" in text
    assert "no agent connected" in text  # pool-9
    cli = render_text(snap)
    assert "... and 9952 more (--offset 50" in cli and len(cli.splitlines()) < 100
    assert "nodes by state: failing 30, unreachable 1000, refused 2, idle 0, ok 8970, direct 0" in cli


def test_filters_and_pages(tmp_path: Path) -> None:
    reg, pools, last, _ = fleet(tmp_path)
    inp = inp_of(reg, pools, last)

    def ask(**params: Any) -> dict[str, Any]:
        pairs = [(k, str(x)) for k, v in params.items() for x in (v if isinstance(v, list) else [v])]
        query = status.parse_query([k for k, _ in pairs], lambda k, d: [v for kk, v in pairs if kk == k] or d)
        return status.build(inp, query)

    refused = ask(state="refused")
    assert [(n["name"], n["refused"]["agent"]) for n in refused["nodes"]] == [("intruder-1", "agent-4"),
                                                                             ("intruder-2", "agent-4")]
    assert "pool-0" in refused["nodes"][0]["refused"]["reason"] and refused["matched"] == 2
    one_pool = ask(pool="pool-3", state=["failing", "ok"], limit=1000)
    assert one_pool["matched"] == 1000 and {n["pool"] for n in one_pool["nodes"]} == {"pool-3"}
    assert one_pool["states"]["unreachable"] == 0 and one_pool["states"]["failing"] == 30  # counts within the pool
    named = ask(q="GPU-7-99")  # a part of the name, any case
    assert sorted(n["name"] for n in named["nodes"]) == ["edge-gpu-7-99", "edge-gpu-7-990", "edge-gpu-7-991",
                                                          "edge-gpu-7-992", "edge-gpu-7-993", "edge-gpu-7-994",
                                                          "edge-gpu-7-995", "edge-gpu-7-996", "edge-gpu-7-997",
                                                          "edge-gpu-7-998", "edge-gpu-7-999"]
    # Paging walks the whole list in order, once: attention first, then each state's nodes by name.
    whole = ask(limit=1000, offset=0)["nodes"]
    pages = [ask(limit=300, offset=o)["nodes"] for o in (0, 300, 600, 900)]
    assert [n["name"] for p in pages for n in p][:1000] == [n["name"] for n in whole]
    assert len(ask(offset=10_000)["nodes"]) == 2 and ask(offset=20_000)["nodes"] == []
    cases: list[tuple[dict[str, str], str]] = [
        ({"state": "sad"}, "state must be one of"), ({"limit": "5000"}, "limit must be"),
        ({"limit": "-1"}, "limit must be"), ({"x": "1"}, "unknown parameter"), ({"q": "a" * 300}, "q: one part")]
    for bad, why in cases:
        def getall(key: str, default: list[str], bad: dict[str, str] = bad) -> list[str]:
            return [bad[key]] if key in bad else default
        with pytest.raises(status.BadStatusQuery, match=why):
            status.parse_query(list(bad), getall)


def test_a_page_links_keep_the_filters_and_escape_what_peers_chose(tmp_path: Path) -> None:
    reg, pools, last, _ = fleet(tmp_path)
    a = agent('evil"<b>', "pool-0")
    reg.add_session(a)
    reg.register(a, [wire.NodeInfo("edge-gpu-0-1", "10.0.0.1", "pool-0"),
                     wire.NodeInfo("x<script>", "10.0.0.1", "pool-0")])
    inp = inp_of(reg, pools, last)
    page = render_html(status.build(inp, status.StatusQuery(frozenset({"pool-0"}), "", frozenset({"refused"}))))
    assert "<script>" not in page and "x&lt;script&gt;" in page and "evil&quot;&lt;b&gt;" in page
    assert 'href="?pool=pool-0&amp;state=failing"' in page  # the state links keep the pool


def test_registrations_rebuild_only_the_node_views_that_changed(tmp_path: Path) -> None:
    reg, _, _, gone = fleet(tmp_path)
    v1, first = reg.node_views()
    assert len(first) == POOLS * PER_POOL and reg.node_views() == (v1, first)  # nothing changed: the same copy
    a0 = next(s for s in reg.sessions.values() if s.agent == "agent-0")
    reg.register(a0, [wire.NodeInfo(f"edge-gpu-0-{k}", "10.0.0.1", "pool-0") for k in range(PER_POOL)])
    assert reg.node_views()[0] == v1  # the agent said the same again: nothing to rebuild
    reg.register(a0, [wire.NodeInfo(f"edge-gpu-0-{k}", "10.0.0.1", "pool-0") for k in range(PER_POOL - 1)])
    v2, second = reg.node_views()
    assert v2 == v1 + 1 and "edge-gpu-0-999" not in second and "edge-gpu-0-999" in first  # first is left as it was
    assert all(second[n] is first[n] for n in second)  # the other 9,999 are the same objects
    back = agent("agent-9", "pool-9")
    reg.add_session(back)
    reg.register(back, [wire.NodeInfo("edge-gpu-9-5", "10.0.0.1", "pool-9")])
    v3, third = reg.node_views()
    assert v3 == v2 + 1 and third["edge-gpu-9-5"].agents == ("agent-9",) and third["edge-gpu-9-5"].released_at is None
    assert "edge-gpu-9-6" not in third and second["edge-gpu-9-6"].released_at is not None  # its list is all it has
    assert gone.agent == "agent-9"
    # Refused claims are kept per agent, bounded, and forgotten when the agent registers anew.
    a4 = next(s for s in reg.sessions.values() if s.agent == "agent-4")
    assert set(reg.refused) == {"intruder-1", "intruder-2"}
    reg.register(a4, [wire.NodeInfo(f"bad-{k}", "10.0.0.1", "pool-z") for k in range(MAX_REFUSED_KEPT + 5)])
    assert len(reg.refused) == MAX_REFUSED_KEPT and reg.refused_dropped == 5 and "intruder-1" not in reg.refused
    reg.remove_session(a4)
    assert reg.refused == {} and reg.refused_dropped == 0


def test_sd_grouped_sends_each_target_once_with_the_labels_its_group_shares(tmp_path: Path) -> None:
    reg, pools, _, _ = fleet(tmp_path)
    _, node_views = reg.node_views()
    per_node = discovery.SdQuery((9100, 9400), frozenset(), frozenset())
    now = time.monotonic()
    old, _ = discovery.groups(node_views.values(), pools, per_node, now, 3600)
    grouped, expires = discovery.groups(node_views.values(), pools, per_node._replace(group="pool"), now, 3600)
    old_size, new_size = len(json.dumps(old)), len(json.dumps(grouped))
    print(f"/sd at 10,000 nodes, 2 ports: one group per node {old_size} bytes, grouped {new_size} bytes")
    assert len(grouped) == POOLS * 2 and new_size < old_size / 4
    assert sorted(t for g in grouped for t in g["targets"]) == sorted(t for g in old for t in g["targets"])
    # What a target's labels were, per target, is what its group says (less node and the agents).
    labels = {t: g["labels"] for g in grouped for t in g["targets"]}
    for g in old:
        want = {k: v for k, v in g["labels"].items() if k not in ("node", "__meta_raven_agents")}
        assert labels[g["targets"][0]] == want
    assert {g["labels"]["__meta_raven_connected"] for g in grouped if g["labels"]["pool"] == "pool-9"} == {"false"}
    assert expires < float("inf")  # pool-9's nodes leave at their rebind deadline: the page says until when


async def test_views_render_off_the_event_loop_and_are_kept_while_nothing_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg, pools, last, _ = fleet(tmp_path)
    v = views.Views(fake_gateway(reg, pools, last))
    rendering = threading.Event()
    threads: set[int] = set()

    def watched(real: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            threads.add(threading.get_ident())
            rendering.set()
            try:
                time.sleep(0.02)  # long enough that the loop must turn during it if it is free
                return real(*args, **kwargs)
            finally:
                rendering.clear()
        return run

    monkeypatch.setattr(status, "build", watched(status.build))
    monkeypatch.setattr(discovery, "groups", watched(discovery.groups))
    async with loop_ticks(rendering) as ticks:
        sd_query = discovery.SdQuery((9400,), frozenset(), frozenset(), "pool")
        pages = await asyncio.gather(*(v.sd(sd_query) for _ in range(5)),
                                     v.status_page(status.StatusQuery(), html=True))
    assert ticks.while_set > 0 and threads and threading.get_ident() not in threads  # in a worker thread
    assert v.sd_pages.renders == 1 and len({id(p) for p in pages[:5]}) == 1  # five readers, one render
    assert json.loads(pages[0].body)[0]["labels"]["pool"] == "pool-0"
    assert b"Raven gateway gw-1" in pages[5].body
    # Kept while nothing changed; made again (another ETag) once the registry changed.
    again = await v.sd(sd_query)
    assert again is pages[0] and v.sd_pages.renders == 1
    a0 = next(s for s in reg.sessions.values() if s.agent == "agent-0")
    reg.remove_session(a0)
    changed = await v.sd(sd_query)
    assert v.sd_pages.renders == 2 and changed.etag != pages[0].etag
    assert len(v.sd_pages._done) == 1  # the new page replaced the old one: churn does not pile up pages


async def test_a_view_read_costs_the_loop_little_at_10000_nodes(tmp_path: Path) -> None:
    """What each read costs the event loop: the snapshot (on a miss) and the lookup; the render is elsewhere."""
    reg, pools, last, _ = fleet(tmp_path)
    v = views.Views(fake_gateway(reg, pools, last))
    reg._stale.update(reg.nodes)
    started = time.perf_counter()
    reg.node_views()  # after the registrations: once per change, not per read
    rebuilt = time.perf_counter() - started
    started = time.perf_counter()
    inp = v.status_input()
    on_loop = time.perf_counter() - started
    print(f"node views rebuilt after a change of all 10,000: {rebuilt * 1000:.1f} ms; status snapshot on the loop: "
          f"{on_loop * 1000:.2f} ms")
    assert len(inp.last) == POOLS * PER_POOL and on_loop < 0.02  # a copy of the last scrapes and a few sessions
    await v.sd(discovery.SdQuery((9400,), frozenset(), frozenset()))
    started = time.perf_counter()
    for _ in range(100):
        await v.sd(discovery.SdQuery((9400,), frozenset(), frozenset()))
    per_read = (time.perf_counter() - started) / 100
    print(f"/sd read when kept: {per_read * 1e6:.0f} us")
    assert per_read < 0.002 and v.sd_pages.renders == 1


async def test_made_up_pools_in_sd_queries_make_no_pages_and_do_not_push_out_prometheus_page(tmp_path: Path) -> None:
    """Review finding: every distinct ``?pool=`` set was a page of its own, so a client with a token could render
    pages without end and push the page Prometheus asks for out of the cache (then 503 while others render)."""
    reg, pools, last, _ = fleet(tmp_path)
    v = views.Views(fake_gateway(reg, pools, last))
    prometheus = discovery.SdQuery((9400,), frozenset(), frozenset(), "pool")
    first = await v.sd(prometheus)
    for i in range(50):
        made_up = discovery.SdQuery((9400,), frozenset({f"nope-{i}", f"nix-{i}"}), frozenset(), "pool")
        assert json.loads((await v.sd(made_up)).body) == []
    assert v.sd_pages.renders == 1 and await v.sd(prometheus) is first
    # A known pool beside a made-up one: the page of the known pool alone (one key for both asks).
    mixed = await v.sd(discovery.SdQuery((9400,), frozenset({"pool-1", "nope"}), frozenset(), "pool"))
    alone = await v.sd(discovery.SdQuery((9400,), frozenset({"pool-1"}), frozenset(), "pool"))
    assert mixed is alone and {g["labels"]["pool"] for g in json.loads(alone.body)} == {"pool-1"}
    with pytest.raises(discovery.BadSdQuery, match="pool name"):
        discovery.parse_query({"pool": "x"}, lambda key, default: ["bad pool\x1b"] if key == "pool" else default,
                              [9400])


async def test_an_older_render_never_replaces_a_newer_page_and_a_busy_cache_serves_a_keys_last_page() -> None:
    from raven.ops.pages import Built, Busy, Page, PageCache

    cache = PageCache(max_age=60, size=1)
    gates = {v: threading.Event() for v in (1, 2)}

    def snapshot(version: int) -> Any:
        def render() -> Built:
            gates[version].wait(5)
            return Built(Page.make(f"v{version}".encode(), "text/plain"))
        return lambda: render

    old = asyncio.create_task(cache.get("k", snapshot(1), 1))
    await asyncio.sleep(0.01)
    with pytest.raises(Busy):  # one render at most, and no page of "k" kept yet
        await cache.get("other", snapshot(2), 2)
    cache.size = 2
    new = asyncio.create_task(cache.get("k", snapshot(2), 2))
    await asyncio.sleep(0.01)
    gates[2].set()
    assert (await new).body == b"v2"
    gates[1].set()
    assert (await old).body == b"v1"  # its reader gets what it waited for ...
    kept = cache.cached("k", 2)
    assert kept is not None and kept.body == b"v2"  # ... the cache keeps v2
    # Busy with renders of other keys: "k" is answered with its last page, out of date, not refused.
    cache.size = 1
    gates[3] = threading.Event()
    other = asyncio.create_task(cache.get("other", snapshot(3), 3))
    await asyncio.sleep(0.01)
    assert (await cache.get("k", snapshot(4), 4)).body == b"v2"
    gates[3].set()
    await other
