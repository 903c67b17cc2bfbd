"""The gateway's part of backfill: the page parser, the remote-write encoder, the batch's checks, the writer."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gateway import exposition, remotewrite
from gateway.catchupbuild import Builder
from gateway.rwclient import Receivers
from raven.backfill import pages
from raven.config.backfill import GatewayBackfill, Receiver
from raven.demo.dcgm_page import render_metrics
from raven.protocol import backfill as bf
from tests.support.rwreceiver import Receiver as FakeReceiver

NOW = 1_800_000_000_000


# ---------------------------------------------------------------- the page


def _reference(page: bytes) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return [(s.name, tuple(sorted(s.labels.items())), s.value)
            for f in text_string_to_metric_families(page.decode()) for s in f.samples]


def test_a_dcgm_page_parses_as_prometheus_client_parses_it() -> None:
    page = render_metrics("edge-gpu-7")
    mine = [(n, tuple(sorted(lb)), v) for n, lb, v in exposition.parse(page)]
    ref = _reference(page)
    # prometheus_client names a counter's samples NAME_total; Prometheus keeps the name the page gives.
    assert [(n, lb, v) for n, lb, v in mine] == [(n.removesuffix("_total") if n not in {m for m, _, _ in mine}
                                                  else n, lb, v) for n, lb, v in ref]
    assert len(mine) > 100


def test_escapes_exemplars_timestamps_and_odd_values() -> None:
    page = (b'# HELP a x\n# TYPE a gauge\na{x="}",y="q\\"\\\\\\n"} 1 1700000000000\n'
            b'b{} +Inf\nc{a="1",} -Inf # {trace="t"} 1.0\nd NaN\n\ne 1e3\n# EOF\n')
    got = exposition.parse(page)
    assert got[0] == ("a", (("x", "}"), ("y", 'q"\\\n')), 1.0)
    assert got[1] == ("b", (), math.inf) and got[2] == ("c", (("a", "1"),), -math.inf)
    assert math.isnan(got[3][2]) and got[4] == ("e", (), 1000.0)


@pytest.mark.parametrize("page", [
    b"a{x=1} 2\n", b'a{x="1" 2\n', b"a\n", b"a b\n", b"a 1 b\n", b"a 1 2 3\n", b'a{x="1",x="2"} 1\n',
    b"\xff\xfe 1\n", b"1a 1\n", b'a{x="1"}1\n',
])
def test_a_page_that_does_not_parse_is_an_error(page: bytes) -> None:
    with pytest.raises(exposition.PageError):
        exposition.parse(page)


def test_a_page_with_too_many_samples_is_refused() -> None:
    with pytest.raises(exposition.PageError, match="more than 10"):
        exposition.parse(b"a 1\n" * 11, max_samples=10)


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_page_error(page: bytes) -> None:
    try:
        exposition.parse(page)
    except exposition.PageError:
        pass


# ---------------------------------------------------------------- remote write


def test_a_known_write_request_encodes_to_its_protobuf_bytes() -> None:
    msg = remotewrite.encode([((("__name__", "up"),), [(1, 1.0)])])
    # timeseries{labels{name:"__name__" value:"up"} samples{value:1.0 timestamp:1}}
    label = b"\x0a\x08__name__\x12\x02up"
    sample = b"\x09" + bytes.fromhex("000000000000f03f") + b"\x10\x01"  # 1.0 as a little-endian double
    series = b"\x0a" + bytes([len(label)]) + label + b"\x12" + bytes([len(sample)]) + sample
    assert msg == b"\x0a" + bytes([len(series)]) + series


@given(st.lists(st.tuples(
    st.lists(st.tuples(st.text(min_size=1, max_size=10), st.text(max_size=20)), max_size=5),
    st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False)), max_size=5)), max_size=5))
def test_write_requests_round_trip(series: list[tuple[list[tuple[str, str]], list[tuple[int, float]]]]) -> None:
    want = [(tuple(lb), s) for lb, s in series]
    assert remotewrite.decode(remotewrite.decompress(remotewrite.compress(remotewrite.encode(want)))) == want


# ---------------------------------------------------------------- a batch's checks


def _batch(pages_by: list[tuple[str, int, int, bytes]]) -> list[bf.Entry]:
    out: list[bf.Entry] = []
    for seq, (node, port, ts, page) in enumerate(pages_by, 1):
        out += [bf.Key(seq, node, pages.compress_key(page)), bf.Scrape(seq, ts, seq, port, node, b"")]
    return out


def _all(b: Builder) -> list[remotewrite.Series]:
    got: list[remotewrite.Series] = []
    while (req := b.next()) is not None:
        got += remotewrite.decode(remotewrite.decompress(req.body))
    return got


def test_only_the_sessions_pool_allowed_ports_and_fresh_timestamps_are_written() -> None:
    cfg = GatewayBackfill(jobs={9400: "edge-dcgm"}, max_age=3600, max_future=60)
    own = {"n1": "pool-a"}
    entries = _batch([
        ("n1", 9400, NOW - 1000, b'g{job="x"} 1\n'),
        ("n2", 9400, NOW, b"g 2\n"),  # another pool's node
        ("n1", 9100, NOW, b"g 3\n"),  # a port without a job
        ("n1", 9400, NOW + 120_000, b"g 4\n"),  # the future
        ("n1", 9400, NOW - 7_200_000, b"g 5\n"),  # too old
        ("n1", 9400, NOW, b"g{ 6\n"),  # does not parse
    ])
    b = Builder(entries, cfg, own.get, NOW)
    got = _all(b)
    assert got == [((("__name__", "g"), ("exported_job", "x"), ("instance", "n1:9400"), ("job", "edge-dcgm"),
                     ("node", "n1"), ("pool", "pool-a")), [(NOW - 1000, 1.0)])]
    assert b.dropped == {"node": 1, "port": 1, "future": 1, "too-old": 1, "bad-page": 1}
    assert b.last_seq == 6
    # A configuration that keeps the discovery's port label (the netns testbed's) gets it too.
    cfg = GatewayBackfill(jobs={9400: "edge-dcgm"}, target_labels=["job", "instance", "port"])
    ((labels, _),) = _all(Builder(_batch([("n1", 9400, NOW, b"g 1\n")]), cfg, own.get, NOW))
    assert labels == (("__name__", "g"), ("instance", "n1:9400"), ("job", "edge-dcgm"), ("port", "9400"))


def test_a_page_over_the_bound_or_a_blob_that_is_not_zstd_is_dropped() -> None:
    cfg = GatewayBackfill(jobs={9400: "j"}, max_page=1024)
    key = b"g 1\n"
    entries: list[bf.Entry] = [bf.Key(1, "n1", pages.compress_key(key)),
                               bf.Scrape(1, NOW, 1, 9400, "n1", pages.compress(b"g 2\n" * 1000, key)),
                               bf.Scrape(2, NOW, 1, 9400, "n1", b"not zstd"),
                               bf.Scrape(3, NOW, 99, 9400, "n1", b"")]  # a key never sent
    b = Builder(entries, cfg, {"n1": "p"}.get, NOW)
    assert _all(b) == [] and b.dropped == {"bad-page": 3}


def test_requests_are_cut_at_samples_per_request() -> None:
    cfg = GatewayBackfill(jobs={9400: "j"}, samples_per_request=100)
    page = b"".join(f"g{i} {i}\n".encode() for i in range(60))
    b = Builder(_batch([("n1", 9400, NOW - i, page) for i in range(5)]), cfg, {"n1": "p"}.get, NOW)
    sizes = []
    while (req := b.next()) is not None:
        sizes.append((req.samples, len(req.parts)))
    assert sizes == [(60, 1)] * 5


# ---------------------------------------------------------------- the writer


async def test_every_receiver_gets_it_transient_failures_are_retried_and_a_400_costs_one_scrape() -> None:
    a, b = FakeReceiver(), FakeReceiver()
    await a.start()
    await b.start()
    try:
        cfg = GatewayBackfill(receivers=[Receiver(url=a.url), Receiver(url=b.url)], jobs={9400: "j"},
                              retry_max=0.2)
        rx = Receivers(cfg)
        entries = _batch([("n1", 9400, NOW - 2000, b"good 1\n"), ("n1", 9400, NOW - 1000, b"bad 2\n"),
                          ("n1", 9400, NOW, b"good 3\n")])
        req = Builder(entries, cfg, {"n1": "p"}.get, NOW).next()
        assert req is not None and len(req.parts) == 3
        a.status = 503  # down for a moment
        b.refuse_metric = "bad"  # refuses any request with it, as Prometheus does for one out-of-bounds sample

        async def recover() -> None:
            await asyncio.sleep(0.5)
            a.status = 204

        fix = asyncio.get_running_loop().create_task(recover())
        refused = await rx.write(req.body, req.parts)
        await fix
        await rx.close()
        assert refused == 1
        assert a.requests > 1 and {dict(k)["__name__"] for k in a.samples} == {"good", "bad"}
        assert {dict(k)["__name__"]: v for k, v in b.samples.items()} == {"good": {NOW - 2000: 1.0, NOW: 3.0}}
    finally:
        await a.close()
        await b.close()


async def test_the_start_up_probe_says_why_a_receiver_cannot_take_writes() -> None:
    cfg = GatewayBackfill(receivers=[Receiver(url="http://127.0.0.1:9/api/v1/write")])
    rx = Receivers(cfg)
    problems = await rx.probe()
    await rx.close()
    assert len(problems) == 1 and "unreachable" in problems[0]


async def test_a_prometheus_without_the_receiver_turns_backfill_off_and_says_why() -> None:
    from prometheus_client import CollectorRegistry

    from gateway.backfill import Backfill
    from gateway.registry import Registry

    rx = FakeReceiver()
    await rx.start()
    try:
        cfg = GatewayBackfill(receivers=[Receiver(url=rx.url.replace("/api/v1/write", "/api/v1/nowhere"))])
        bfs = Backfill(cfg, Registry(), CollectorRegistry())
        await bfs.start()
        await bfs.stop()
        assert "--web.enable-remote-write-receiver" in bfs.off_reason
        assert Backfill(GatewayBackfill(), Registry(), CollectorRegistry()).off_reason.startswith("no receivers")
    finally:
        await rx.close()


def test_status_and_raven_status_show_each_pools_backlog_and_why_backfill_is_off(tmp_path: object) -> None:
    from pathlib import Path

    from gateway import status
    from gateway.statuspage import render_html, render_text
    from tests.support.fleetviews import fleet, inp_of

    reg, pools, last, _ = fleet(Path(str(tmp_path)))
    inp = inp_of(reg, pools, last)
    inp.backfill = {"off": "", "pools": {"pool-3": {"bytes": 4_500_000, "scrapes": 800, "minutes": 12.5}}}
    snap = status.build(inp)
    assert next(p for p in snap["pools"] if p["pool"] == "pool-3")["backlog"]["minutes"] == 12.5
    assert "pool pool-3: backlog of 12.5 min, 4.5 MB (800 scrapes)" in render_text(snap)
    assert "backlog: 12.5 min, 4.5 MB" in render_html(snap)
    inp.backfill = {"off": "no receivers configured (backfill.receivers)", "pools": {}}
    assert "backfill is off: no receivers configured" in render_text(status.build(inp))


async def test_the_old_switch_interval_still_loads_is_ignored_and_said_to_be(caplog: pytest.LogCaptureFixture) -> None:
    """An operator's file that sets backfill.switch_interval keeps loading; the gateway leaves the interpreter's
    switch interval alone (the parsing left its process: gateway/catchupworker.py) and says so."""
    import sys

    from prometheus_client import CollectorRegistry

    from gateway.backfill import Backfill
    from gateway.registry import Registry

    rx = FakeReceiver()
    await rx.start()
    before = sys.getswitchinterval()
    try:
        cfg = GatewayBackfill(receivers=[Receiver(url=rx.url)], switch_interval=0.0005)
        bfs = Backfill(cfg, Registry(), CollectorRegistry())
        await bfs.start()
        await bfs.stop()
        assert not bfs.off_reason and sys.getswitchinterval() == before
        assert "backfill.switch_interval is deprecated and ignored" in caplog.text
    finally:
        sys.setswitchinterval(before)
        await rx.close()
