"""The agent's bounded buffer of scrapes kept through an outage, in memory and on a volume when one is set.

Scrapes are kept in segments of ``segment_seconds`` (5 minutes by default). In a segment the first page of each
node is its key (zstd on its own); the node's later pages are compressed against that key (raven/backfill/pages.py),
so a segment needs nothing outside itself and is dropped whole. The buffer holds at most ``byte_cap`` bytes and
nothing older than ``age_cap`` seconds: past either, the oldest segment goes first, its scrapes counted as dropped.

With a ``directory`` each segment is also a file of raven/protocol/backfill.py's entries, appended as scrapes
come, and ``acked`` holds the last sequence number the gateway acknowledged: an agent that restarts reads them back
(a torn last entry is left out). What the gateway acknowledges leaves the buffer (:meth:`ack`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from raven.backfill import pages
from raven.protocol import backfill as bf

log = logging.getLogger("raven.agent.backlog")

OVERHEAD = 96  # bytes counted per kept scrape beyond its blob: its Python object and its place in the lists
SEGMENT_SECONDS = 300.0
DEFAULT_BYTE_CAP = 256 * 1024 * 1024
DEFAULT_AGE_CAP = 6 * 3600.0


@dataclass(slots=True)
class _Segment:
    start: float  # wall-clock seconds of its first scrape
    keys: dict[str, bf.Key] = field(default_factory=dict)  # node -> its key page in this segment
    scrapes: list[bf.Scrape] = field(default_factory=list)
    bytes: int = 0
    path: Path | None = None
    newest_ms: int = 0


class Backlog:
    def __init__(self, byte_cap: int = DEFAULT_BYTE_CAP, age_cap: float = DEFAULT_AGE_CAP,
                 directory: Path | None = None, segment_seconds: float = SEGMENT_SECONDS,
                 max_page: int = bf.MAX_ENTRY, on_drop: Callable[[str, int], None] | None = None) -> None:
        self.byte_cap = byte_cap
        self.age_cap = age_cap
        self.directory = directory
        self.segment_seconds = segment_seconds
        self.max_page = max_page
        self.on_drop = on_drop  # (reason, scrapes): "full", "age" (a metric counts them)
        self._segments: list[_Segment] = []
        self.bytes = 0
        self.scrapes = 0
        self.next_seq = 1
        self.acked = 0
        self.dropped = 0
        self._fresh = False  # the next scrape starts a segment (after a restart: keys are made afresh)
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._load(directory)

    # ------------------------------------------------------------ state

    @property
    def oldest_ms(self) -> int:
        for seg in self._segments:
            if seg.scrapes:
                return seg.scrapes[0].ts_ms
        return 0

    @property
    def newest_ms(self) -> int:
        return max((s.newest_ms for s in self._segments), default=0)

    # ------------------------------------------------------------ adding

    def add(self, node: str, port: int, ts_ms: int, page: bytes) -> None:
        """Keep one page of ``node`` scraped at ``ts_ms`` (Unix milliseconds); then hold the caps."""
        seg = self._segments[-1] if self._segments else None
        if seg is None or self._fresh or ts_ms / 1000 - seg.start >= self.segment_seconds:
            seg = self._new_segment(ts_ms / 1000)
            self._fresh = False
        seq = self.next_seq
        self.next_seq += 1
        key = seg.keys.get(node)
        written: list[bf.Entry] = []
        if key is None:
            key = seg.keys[node] = bf.Key(seq, node, pages.compress_key(page))
            written.append(key)
            seg.bytes += len(key.blob) + OVERHEAD
            self.bytes += len(key.blob) + OVERHEAD
            blob = b""  # the page is its key
        else:
            blob = pages.compress(page, pages.decompress_key(key.blob, self.max_page))
        scrape = bf.Scrape(seq, ts_ms, key.key, port, node, blob)
        written.append(scrape)
        seg.scrapes.append(scrape)
        seg.newest_ms = max(seg.newest_ms, ts_ms)
        seg.bytes += len(blob) + OVERHEAD
        self.bytes += len(blob) + OVERHEAD
        self.scrapes += 1
        if seg.path is not None:
            self._append(seg.path, written)
        self.hold(ts_ms / 1000)

    def _new_segment(self, start: float) -> _Segment:
        seg = _Segment(start)
        if self.directory is not None:
            seg.path = self.directory / f"seg-{self.next_seq:020d}.bf"
        self._segments.append(seg)
        return seg

    def hold(self, now: float) -> None:
        """Drop the oldest segments while over the byte cap, and those all older than the age cap."""
        while self._segments and (self.bytes > self.byte_cap
                                  or self._segments[0].newest_ms / 1000 < now - self.age_cap):
            seg = self._segments[0]
            reason = "full" if self.bytes > self.byte_cap else "age"
            self._remove(seg)
            if seg.scrapes:
                self.dropped += len(seg.scrapes)
                log.warning("backlog %s: dropped %d kept scrape(s) from %.0f s ago (cap %d bytes, %.0f s)", reason,
                            len(seg.scrapes), now - seg.start, self.byte_cap, self.age_cap)
                if self.on_drop is not None:
                    self.on_drop(reason, len(seg.scrapes))

    def _remove(self, seg: _Segment) -> None:
        self._segments.remove(seg)
        self.bytes -= seg.bytes
        self.scrapes -= len(seg.scrapes)
        if seg.path is not None:
            with contextlib.suppress(FileNotFoundError):
                seg.path.unlink()

    # ------------------------------------------------------------ sending back

    def ack(self, seq: int) -> int:
        """The gateway wrote every scrape up to ``seq``: they leave. Returns how many left."""
        if seq <= self.acked:
            return 0
        seq = min(seq, self.next_seq - 1)  # never past what was handed out
        self.acked = seq
        gone = 0
        for seg in list(self._segments):
            keep = [s for s in seg.scrapes if s.seq > seq]
            n = len(seg.scrapes) - len(keep)
            if not n:
                continue
            gone += n
            self.scrapes -= n
            freed = sum(len(s.blob) + OVERHEAD for s in seg.scrapes if s.seq <= seq)
            seg.scrapes = keep
            seg.bytes -= freed
            self.bytes -= freed
            if not keep and seg is not self._segments[-1]:
                self._remove(seg)
        if self.directory is not None:
            _write_atomic(self.directory / "acked", f"{seq}\n".encode())
        return gone

    def batch(self, max_bytes: int) -> list[bf.Entry]:
        """The oldest scrapes not yet acknowledged, each after its key, about ``max_bytes`` of them (at least one)."""
        out: list[bf.Entry] = []
        size = 0
        for seg in self._segments:
            sent: set[int] = set()
            for s in seg.scrapes:
                if out and size >= max_bytes:
                    return out
                key = seg.keys[s.node]
                if key.key not in sent:
                    sent.add(key.key)
                    out.append(key)
                    size += len(key.blob)
                out.append(s)
                size += len(s.blob) + 40
        return out

    # ------------------------------------------------------------ the volume

    def _append(self, path: Path, entries: list[bf.Entry]) -> None:
        try:
            with path.open("ab") as f:
                f.write(b"".join(bf.encode(e) for e in entries))
        except OSError as exc:
            log.warning("backlog: cannot write %s (%s): kept in memory only", path, exc.strerror)

    def _load(self, directory: Path) -> None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.acked = int((directory / "acked").read_text().strip() or 0)
        self.next_seq = self.acked + 1
        for path in sorted(directory.glob("seg-*.bf")):
            seg = _Segment(0.0, path=path)
            dec = bf.Decoder(max_entry=self.max_page)
            try:
                with path.open("rb") as f:
                    while chunk := f.read(1 << 20):
                        for entry in dec.feed(chunk):
                            self._restore(seg, entry)
            except (OSError, bf.BackfillError) as exc:
                log.warning("backlog: %s read up to a bad entry (%s)", path.name, exc)
            if seg.scrapes:
                seg.start = seg.scrapes[0].ts_ms / 1000
                self._segments.append(seg)
                self.bytes += seg.bytes
                self.scrapes += len(seg.scrapes)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
        if self._segments:
            self._segments.sort(key=lambda s: s.scrapes[0].seq)
            self._fresh = True
            log.info("backlog: %d scrape(s) (%d bytes) read back from %s", self.scrapes, self.bytes, directory)

    def _restore(self, seg: _Segment, entry: bf.Entry) -> None:
        self.next_seq = max(self.next_seq, (entry.key if isinstance(entry, bf.Key) else entry.seq) + 1)
        if isinstance(entry, bf.Key):
            seg.keys[entry.node] = entry
            seg.bytes += len(entry.blob) + OVERHEAD
        elif entry.seq > self.acked and entry.node in seg.keys:
            seg.scrapes.append(entry)
            seg.newest_ms = max(seg.newest_ms, entry.ts_ms)
            seg.bytes += len(entry.blob) + OVERHEAD


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("backlog: cannot write %s (%s)", path, exc.strerror)
