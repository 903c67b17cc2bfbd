"""Scraping through a bad uplink (issue 20, item 3): the real Prometheus scrapes 50 simulated nodes of site a
through the tunnel every 5 s, with the product's default heartbeat and reconnect settings, while site a's uplink
is slow and lossy (150 ms round trip, 1 % lost each way, 5 Mbit/s), then cut for 30 s and restored.

Correctness: no failed scrape while the link is merely bad, no session dropped by the heartbeat then, and
every node scraped successfully again after the link returns (a generous bound). The figures (durations, how
fast the way back is) are printed, not asserted: bench/bench_uplink.py measures them, docs/uplinks.md has them.
One timing is asserted, because it is the finding (issue 29 item 9) and its margin is wide: with two
incompressible downloads through the same tunnel, the scrapes' p99 stays within twice the idle link's (4.6x
before the session kept its backlog and scheduled it; 1.2x after; on a loaded machine a second pair of windows
decides when the first misses).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.support.linkbed import LOSSY, LinkBed, lossy_phase, outage_phase

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

INTERVAL = 5.0
WINDOW = 30.0  # each lossy window: 50 nodes every 5 s, ~300 scrapes (the p99 is about their 3rd slowest)
OUTAGE = 30.0
WAY_BACK_BOUND = 60.0  # generous: the agents' redial within 2 s, a handshake over 150 ms, SD refresh, one scrape
IDLE: dict[str, float] = {}  # the idle lossy link's figures, for the bulk test beside them


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LinkBed]:
    tb = LinkBed(tmp_path_factory.mktemp("raven-uplinks"), count=50, scrape_interval=INTERVAL)
    try:
        await tb.start()
        await tb.wait_all_up(150)
        yield tb
    finally:
        await tb.close()


async def test_a_slow_lossy_uplink_fails_no_scrape_and_drops_no_session(bed: LinkBed) -> None:
    out = await lossy_phase(bed, LOSSY, WINDOW)
    print(f"\nlossy link: {out['scrapes']:.0f} scrapes, {out['failed']:.0f} failed, duration p50 "
          f"{out['p50'] * 1000:.0f} ms p99 {out['p99'] * 1000:.0f} ms max {out['max'] * 1000:.0f} ms, heartbeat drops "
          f"{out['heartbeat_drops']}")
    assert out["scrapes"] >= 0.75 * 50 * WINDOW / INTERVAL, out  # every node scraped about every 5 s
    assert out["failed"] == 0, out
    assert out["heartbeat_drops"] == 0, out["drops_by_process"]
    IDLE.update(p99=out["p99"])


async def test_scrapes_do_not_wait_behind_downloads_on_the_same_tunnel(bed: LinkBed) -> None:
    if "p99" not in IDLE:  # run alone: the idle figures first
        IDLE.update(p99=(await lossy_phase(bed, LOSSY, WINDOW))["p99"])
    # A busy machine (CI runs the suite beside other work) moves a p99 of ~300 scrapes by tens of ms: when the
    # first pair misses, the idle link and the downloads are measured again back to back and that pair decides.
    # Without the scheduler the ratio was 4.6x in every run, so a second chance does not hide it.
    for attempt in (1, 2):
        if attempt == 2:
            IDLE.update(p99=(await lossy_phase(bed, LOSSY, WINDOW))["p99"])
        out = await lossy_phase(bed, LOSSY, WINDOW, downloads=2)
        print(f"\nlossy link with 2 downloads (pair {attempt}): {out['scrapes']:.0f} scrapes, {out['failed']:.0f} "
              f"failed, duration p50 {out['p50'] * 1000:.0f} ms p99 {out['p99'] * 1000:.0f} ms (idle "
              f"{IDLE['p99'] * 1000:.0f} ms) max {out['max'] * 1000:.0f} ms; {out['downloads']} downloads completed, "
              f"{out['download_bytes']} bytes")
        assert out["downloads"] >= 2 and not out["download_errors"], out  # the bulk load was there
        assert out["scrapes"] >= 0.75 * 50 * WINDOW / INTERVAL and out["failed"] == 0, out
        assert out["heartbeat_drops"] == 0, out["drops_by_process"]
        if out["p99"] <= 2 * IDLE["p99"]:
            break
    assert out["p99"] <= 2 * IDLE["p99"], (out, IDLE)


async def test_after_a_30s_cut_every_node_is_scraped_again(bed: LinkBed) -> None:
    out = await outage_phase(bed, LOSSY, OUTAGE, bound=WAY_BACK_BOUND)
    print(f"\noutage {OUTAGE:g}s: sessions gone {out['sessions_gone_after']:.1f}s after the cut; after the return: "
          f"sessions back {out['sessions_back_after']:.1f}s, every node scraped OK {out['every_node_up_after']:.1f}s; "
          f"up == 0 during the cut: {out['down_during_cut']} nodes")
    assert out["sessions_gone_after"] < OUTAGE, out  # the heartbeat noticed the cut (and the scrapes failed)
    # The cut site's nodes stayed discovery targets (bound to their pool), so the outage is up == 0, not gone.
    assert out["down_during_cut"] == len(bed.busy.nodes), out
    late = {n: t for n, t in out["nodes_back"].items() if t == float("inf")}
    assert len(out["nodes_back"]) == len(bed.busy.nodes) and not late, late
    other = await bed.query(f'up{{job="edge-dcgm", pool="{bed.sites[1].pool}"}}')
    assert set(other.values()) == {1.0}, other  # the other site never noticed
