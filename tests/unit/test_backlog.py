"""The agent's backlog (agent/backlog.py): compression against a key, the caps, acknowledgements, the volume."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from agent.backlog import DEFAULT_BYTE_CAP, Backlog
from raven.backfill import pages
from raven.demo.dcgm_page import NodeModel
from raven.protocol import backfill as bf

T0 = 1_800_000_000_000  # ms


def _pages_back(entries: list[bf.Entry]) -> dict[int, bytes]:
    """What a gateway reads out of a batch: seq -> page."""
    keys: dict[int, bytes] = {}
    out: dict[int, bytes] = {}
    for e in entries:
        if isinstance(e, bf.Key):
            keys[e.key] = pages.decompress_key(e.blob, 1 << 24)
        else:
            key = keys[e.key]
            out[e.seq] = key if not e.blob else pages.decompress(e.blob, key, 1 << 24)
    return out


def test_pages_come_back_exactly_after_their_key(tmp_path: Path) -> None:
    models = {n: NodeModel(n, interval=15) for n in ("edge-gpu-1", "edge-gpu-2")}
    kept: dict[int, bytes] = {}
    b = Backlog(segment_seconds=60)
    for tick in range(10):  # 150 s: three segments
        for node, m in models.items():
            page = m.render(tick)
            b.add(node, 9400, T0 + tick * 15_000, page)
            kept[b.next_seq - 1] = page
    assert _pages_back(b.batch(1 << 30)) == kept


_MODELS = [NodeModel(f"edge-gpu-{i}", interval=15) for i in range(8)]


def test_sizing_a_1000_node_pool_at_15s_for_30_minutes_fits_the_default_cap() -> None:
    """Consecutive dcgm pages differ in values only: measured on 8 nodes for 30 minutes, scaled to 1,000."""
    nodes, scrapes = 8, 120  # 30 minutes at 15 s
    b = Backlog()
    raw = 0
    for tick in range(scrapes):
        for i in range(nodes):
            page = _MODELS[i].render(tick)
            raw += len(page)
            b.add(f"edge-gpu-{i}", 9400, T0 + tick * 15_000, page)
    per_node_30min = b.bytes / nodes
    per_node_hour = 2 * per_node_30min
    logging.getLogger(__name__).warning("backlog: %.0f bytes per node per hour (raw pages %.0f), ratio %.1f",
                                        per_node_hour, 2 * raw / nodes, raw / b.bytes)
    assert 1000 * per_node_30min <= DEFAULT_BYTE_CAP / 2  # holds 30 minutes of 1,000 nodes with room to spare
    assert raw / b.bytes > 40  # 50 KB pages kept in about 1 KB


def test_the_byte_cap_drops_the_oldest_segment_and_counts_it() -> None:
    dropped: list[tuple[str, int]] = []
    b = Backlog(byte_cap=2 << 20, segment_seconds=60, on_drop=lambda r, n: dropped.append((r, n)))
    for i in range(4):
        b.add("n1", 9400, T0 + i * 60_000, os.urandom(1 << 20))  # 1 MiB that does not compress
    assert b.bytes <= 2 << 20
    assert dropped and dropped[0][0] == "full"
    assert b.dropped == sum(n for _, n in dropped)
    assert b.oldest_ms > T0  # the oldest went first


def test_the_age_cap_drops_what_is_too_old() -> None:
    b = Backlog(age_cap=600, segment_seconds=60)
    b.add("n1", 9400, T0, b"a 1\n")
    b.add("n1", 9400, T0 + 700_000, b"a 2\n")
    assert b.scrapes == 1 and b.oldest_ms == T0 + 700_000 and b.dropped == 1


def test_ack_drops_what_was_written_and_never_more_than_was_handed_out() -> None:
    b = Backlog()
    for i in range(5):
        b.add("n1", 9400, T0 + i * 1000, f"a {i}\n".encode())
    first = b.batch(1)  # at least one scrape, after its key
    assert [type(e) for e in first] == [bf.Key, bf.Scrape]
    assert b.ack(first[-1].seq if isinstance(first[-1], bf.Scrape) else 0) == 1
    assert b.scrapes == 4
    assert b.ack(10**9) == 4 and b.scrapes == 0 and b.acked == 5
    assert b.batch(1 << 20) == []


def test_a_restart_reads_the_volume_back_without_what_was_acknowledged(tmp_path: Path) -> None:
    b = Backlog(directory=tmp_path, segment_seconds=60)
    for i in range(6):
        b.add("n1", 9400, T0 + i * 30_000, f"a {i}\n".encode())
    b.ack(2)
    again = Backlog(directory=tmp_path, segment_seconds=60)
    got = _pages_back(again.batch(1 << 20))
    assert got == {s: f"a {s - 1}\n".encode() for s in range(3, 7)}
    assert again.next_seq == 7
    again.add("n1", 9400, T0 + 200_000, b"a 6\n")  # a fresh segment with its own key
    assert _pages_back(again.batch(1 << 20))[7] == b"a 6\n"


def test_a_torn_last_entry_on_the_volume_is_left_out(tmp_path: Path) -> None:
    b = Backlog(directory=tmp_path)
    for i in range(3):
        b.add("n1", 9400, T0 + i * 1000, f"a {i}\n".encode())
    seg = next(tmp_path.glob("seg-*.bf"))
    seg.write_bytes(seg.read_bytes()[:-3])
    again = Backlog(directory=tmp_path)
    assert sorted(_pages_back(again.batch(1 << 20))) == [1, 2]
