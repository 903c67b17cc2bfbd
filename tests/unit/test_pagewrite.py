"""gateway/pagewrite.py against the simple path it replaced (tests/support/simplewrite.py: exposition.parse, the
labels merged as Prometheus does, remotewrite.encode): the same bytes for every page, the same PageError (same
message) for every page that does not parse, with a target's label sets kept from its earlier pages; the cache of
kept label sets bounded; and a target's next page read without the strict reader."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import exposition, pagewrite
from raven.demo.dcgm_page import NodeModel
from tests.support.simplewrite import simple_write

TS = 1_800_000_000_123
TARGET = {"job": "edge-dcgm", "instance": "n1:9400", "node": "n1", "pool": "pool-a"}


def outcome(fn: object, *args: object) -> tuple[bytes, int] | str:
    try:
        return fn(*args)  # type: ignore[operator, no-any-return]
    except exposition.PageError as exc:
        return f"PageError: {exc}"


def check_pages(pages: list[bytes], target: dict[str, str] = TARGET, ts_ms: int = TS) -> None:
    """Every page, in turn, through one target's series (kept from the pages before it) as the reference has it."""
    series = pagewrite.TargetSeries(target)
    for page in pages:
        want = outcome(simple_write, page, target, ts_ms)
        got = outcome(pagewrite.encode_page, page, series, ts_ms)
        assert got == want, page


# ---------------------------------------------------------------- pages made of the grammar's hard parts

# Each part of a line: mostly what parses (so that label sets are kept and then met again), at times what does not.
NAMES = (["a", "up", "DCGM_FI_DEV_GPU_UTIL", "x:y_z", "_u", "__name__"], ["1a", "a-b", "a b", "a{", ""])
LABEL_NAMES = (["gpu", "job", "instance", "pool", "exported_job", "__name__", "UUID", "_x"], ["9z", "a b", ""])
LABEL_VALUES = (["0", "", "GPU-1", "} 1", "a\\\"b", "back\\\\slash", "nl\\n", "odd\\q", "{", "p q", "ü✓", "#",
                 "}", "x\ty"], ['"', "\\", "a\nb"])
EQUALS = (["=", " = ", "\t="], ["==", "", ":"])
SET_ENDS = (["}", ",}", " }", ", }"], ["", "}}", ",,}", "} "])
VALUES = (["1", "0", "-2.5", "1e3", "1.5E-7", "NaN", "nan", "-nan", "+Inf", "-Inf", "inf", "Infinity", "1_000",
           "\uff11", "1e400", "-0", ".5", "1.", "\t1", "1\x0b"],
          ["", "abc", "0x10", "\x0b1", "nan\x0b", "\xa01", "1 2 3"])
TAILS = (["", "", "", " 1700000000000", "\t-12", " # {trace=\"t\"} 1.0", " #", " # x", "  ", " \x0b"],
         [" x", " 1 2", " 1.5.5", "\x0b2"])
GAPS = ([" ", " ", "\t", "  ", " \t"], ["", "\x0b", "\xa0"])


@st.composite
def part(draw: st.DrawFn, choices: tuple[list[str], list[str]]) -> str:
    good, bad = choices
    return draw(st.sampled_from(bad if draw(st.integers(0, 11)) == 0 else good))


@st.composite
def label_set(draw: st.DrawFn) -> str:
    pairs = draw(st.lists(st.tuples(part(LABEL_NAMES), part(EQUALS), part(LABEL_VALUES)), max_size=4))
    body = ",".join(f'{k}{eq}"{v}"' for k, eq, v in pairs)
    return "{" + draw(st.sampled_from(["", " ", "\t"])) + body + draw(part(SET_ENDS))


@st.composite
def heads(draw: st.DrawFn) -> list[str]:
    """The heads a target's pages repeat: NAME, NAME{SET}."""
    sets = draw(st.lists(label_set(), min_size=1, max_size=3))
    return [draw(part(NAMES)) + draw(st.sampled_from(["", *sets])) for _ in range(draw(st.integers(1, 4)))]


@st.composite
def page_of(draw: st.DrawFn, shared: list[str]) -> bytes:
    lines: list[str] = []
    for _ in range(draw(st.integers(0, 10))):
        if draw(st.integers(0, 7)) == 0:
            lines.append(draw(st.sampled_from(["# HELP a x", "# TYPE a gauge", "", "   ", "\t", "# EOF", " # x"])))
        else:
            lines.append(draw(st.sampled_from(shared)) + draw(part(GAPS)) + draw(part(VALUES)) + draw(part(TAILS)))
    end = draw(st.sampled_from(["\n", "\n", "\r\n", "\r\r\n"]))
    return (end.join(lines) + draw(st.sampled_from(["", end]))).encode()


@st.composite
def page_runs(draw: st.DrawFn) -> list[bytes]:
    shared = draw(heads())
    return draw(st.lists(page_of(shared), min_size=1, max_size=6))


@pytest.mark.parametrize("pages", [
    [b"a 1\n", b"a{ 1\n"],  # NAME{ is not NAME
    [b'a{x="1"} 1\n', b'a{x="1"} \x0b1\n', b'a{x="1"} \t1\n'],  # a blank before the value that is not a space or tab
    [b'a{__name__="b"} 1\n', b'c{__name__="b"} 2\n'],  # the page's own __name__ takes the name's place
    [b'a{x="} 1"} 1\n', b'a{x="} 1"} 2\n', b'a{x="}"} 3\n', b'a{x="} 1",y="2"} 4\n'],  # a quoted }
    [b'a{x="1"} 1\n', b'a{x="1"} nan\n', b'a{x="1"} NaN \n', b'a{x="1"} nan\x0b\n'],  # NaN as it is spelled
    [b'a{x="1"} 1\n', b'a{x="1"} 1 2\n', b'a{x="1"} 1 # {t="u"} 2\n', b'a{x="1"} 1 x\n'],  # what follows
])
def test_the_cases_a_kept_label_set_must_not_mistake(pages: list[bytes]) -> None:
    check_pages(pages)


@settings(max_examples=400, deadline=None)
@given(page_runs())
def test_a_targets_pages_of_the_grammars_hard_parts_are_written_as_the_simple_path_writes_them(
        pages: list[bytes]) -> None:
    check_pages(pages)


@settings(max_examples=150, deadline=None)
@given(page_runs(), st.sampled_from([{}, {"job": "j"}, {"__x": "1", "gpu": "g"}]),
       st.sampled_from([0, 1, 127, 128, -1, TS, 2**63 - 1, -(2**63)]))
def test_any_target_labels_and_timestamp(pages: list[bytes], target: dict[str, str], ts_ms: int) -> None:
    check_pages(pages, target, ts_ms)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.text(alphabet='ab_:{}=",\\ \t\r\n#1.eN+-x\x0bü', max_size=120), min_size=1, max_size=4))
def test_random_text_over_the_grammars_characters(texts: list[str]) -> None:
    check_pages([t.encode() for t in texts])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=3))
def test_random_bytes(pages: list[bytes]) -> None:
    check_pages(pages)


def test_dcgm_pages_and_their_mutations_through_one_targets_series() -> None:
    """Real pages of one node in turn, then each with a line broken: a broken line after kept sets is an error
    at the same line, a changed set is read afresh."""
    model = NodeModel("edge-gpu-3")
    pages = [model.render(t) for t in range(4)]
    rng = random.Random(7)
    mutants = []
    for _ in range(150):
        lines = pages[rng.randrange(4)].split(b"\n")
        i = rng.randrange(len(lines))
        line = bytearray(lines[i])
        at = rng.randrange(len(line) + 1)
        op = rng.randrange(3)
        if op == 0 and line:
            del line[min(at, len(line) - 1)]
        elif op == 1:
            line[at:at] = rng.choice([b" ", b"}", b"{", b'"', b"\\", b",", b"\t", b"x", b"\r", b"#", b"\x0b"])
        else:
            line[at:] = rng.choice([b" 1 2", b" NaN", b" # {a=\"b\"} 1", b"} 3", b"", b" +Inf"])
        lines[i] = bytes(line)
        mutants.append(b"\n".join(lines))
    check_pages(pages + mutants + pages)


def test_too_many_samples_is_the_same_error() -> None:
    page = b"a 1\n" * 11
    with pytest.raises(exposition.PageError, match="more than 10"):
        pagewrite.encode_page(page, pagewrite.TargetSeries(TARGET), TS, max_samples=10)


# ---------------------------------------------------------------- what it saves, and its bounds


def test_a_targets_next_page_is_written_without_the_strict_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    model = NodeModel("edge-gpu-1")
    series = pagewrite.TargetSeries(TARGET)
    first = pagewrite.encode_page(model.render(0), series, TS)
    assert first == simple_write(model.render(0), TARGET, TS)
    page = model.render(1)
    want = simple_write(page, TARGET, TS + 15_000)
    read: list[str] = []
    real = exposition.read_line

    def counted(line: str, lineno: int) -> tuple[exposition.Sample, int] | None:
        read.append(line)
        return real(line, lineno)

    monkeypatch.setattr(exposition, "read_line", counted)
    assert pagewrite.encode_page(page, series, TS + 15_000) == want
    assert read == []  # every label set and name was kept: only the values were read
    assert len(series.sets) == 40  # dcgm-exporter's 8 GPUs and 32 processes


def test_the_cache_keeps_its_byte_budget_and_the_targets_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    page = NodeModel("n").render(0)
    one = pagewrite.TargetSeries(TARGET)
    pagewrite.encode_page(page, one, TS)
    per_target = one.grown
    cache = pagewrite.SeriesCache(max_bytes=int(per_target * 3.5), keep_in_use=60.0)

    def write(node: str) -> None:
        series = cache.target(node, 9400, {**TARGET, "node": node})
        pagewrite.encode_page(page, series, TS)
        cache.done(node, 9400, series)
        assert cache.size <= cache.max_bytes

    for k in range(5):  # a catch-up cycling through 5 targets: the first 3 stay, the others are read afresh
        write(f"n{k}")
    assert sorted(n for n, _ in cache._targets) == ["n0", "n1", "n2"]
    clock[0] += 61  # n0..n2 idle: a new target pushes out the least recently used
    write("n1")
    write("n9")
    assert sorted(n for n, _ in cache._targets) == ["n1", "n2", "n9"]
    assert cache.size == sum(t.size for t in cache._targets.values())
    # The node moved to another pool: its labels changed, its series are read afresh.
    moved = cache.target("n1", 9400, {**TARGET, "node": "n1", "pool": "pool-b"})
    assert moved.sets == {} and len(cache) == 2
    # A page bigger than the budget is written, and not kept.
    huge = b"".join(b'g{i="%d"} 1\n' % i for i in range(2000))
    series = cache.target("big", 9400, TARGET)
    assert pagewrite.encode_page(huge, series, TS) == simple_write(huge, TARGET, TS)
    cache.done("big", 9400, series)
    assert ("big", 9400) not in cache._targets and cache.size <= cache.max_bytes


def test_the_builder_writes_batches_as_the_simple_path_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches as an agent sends them (several nodes, keys resent in each batch, a page that does not parse): the
    same requests, byte for byte, and the same drops, with the gateway's cache kept across the batches."""
    from agent.backlog import Backlog
    from gateway import catchupbuild
    from raven.config.backfill import GatewayBackfill
    from raven.protocol import backfill as bf

    kept = Backlog()
    models = [NodeModel(f"edge-gpu-{i}", gpus=2, processes_per_gpu=2) for i in range(3)]
    for tick in range(6):
        for i, model in enumerate(models):
            page = model.render(tick) if (i, tick) != (1, 3) else b'broken{gpu="0" 1\n'
            kept.add(f"edge-gpu-{i}", 9400, TS + tick * 15_000, page)
    batches = []
    while kept.scrapes:
        batches.append(kept.batch(1500))
        kept.ack(max(e.seq for e in batches[-1] if isinstance(e, bf.Scrape)))
    assert len(batches) > 2
    cfg = GatewayBackfill(jobs={9400: "edge-dcgm"}, samples_per_request=100)

    def write(series: pagewrite.SeriesCache) -> tuple[list[tuple[bytes, list[bytes], int]], dict[str, int]]:
        out: list[tuple[bytes, list[bytes], int]] = []
        dropped: dict[str, int] = {}
        for entries in batches:
            b = catchupbuild.Builder(entries, cfg, lambda node: "pool-a", TS + 100_000, series)
            while (req := b.next()) is not None:
                out.append((req.body, req.parts, req.samples))
            for reason, n in b.dropped.items():
                dropped[reason] = dropped.get(reason, 0) + n
        return out, dropped

    cache = pagewrite.SeriesCache()
    got = write(cache)
    assert len(cache) == 3 and got[1] == {"bad-page": 1}
    with monkeypatch.context() as m:
        m.setattr(pagewrite, "encode_page", lambda page, series, ts: simple_write(page, series.labels, ts))
        assert write(pagewrite.SeriesCache()) == got
