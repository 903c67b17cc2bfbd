"""A kept scrape's page straight into its part of a remote-write request: byte for byte what the simple path wrote
(``exposition.parse``, the target's labels merged in as Prometheus does, ``remotewrite.encode``), the same
:class:`~gateway.exposition.PageError` (same line, same words) for a page that does not parse, at a fraction of
the CPU (docs/backfill.md has the figures).

Where the time went: a 50 KB dcgm-exporter page has 176 samples of 7 to 10 labels, and reading, merging, sorting
and encoding some 1,600 labels one by one cost nearly all of the gateway's 6 to 15 ms per kept scrape (zstd and
snappy: a few hundredths of a millisecond). But a page has few label sets (dcgm-exporter: 40, one per GPU and one
per process, each under 14 or 2 metric names), and consecutive pages of one exporter repeat them and differ in
values. So each target keeps (:class:`TargetSeries`), for each label set it has read, the text between its braces
and its labels merged with the target's, sorted and encoded, in two parts around the place of ``__name__``; and
each metric name it has read, encoded. A line ``NAME{SET} VALUE`` is split at its last space and its first
``{``; when the set's text and the name are ones the target has read, and the value is a number, only the value is
read. Any other line (a new set or name, NaN, a timestamp, an exemplar, a comment, what does not parse) goes
through ``exposition.read_line``, the strict reader, which raises what it raises; the set it read is kept.

Why a kept text stands for its labels: a label set's extent is fixed by its text (a quoted string ends at the first
unescaped quote, the set at the first ``}`` outside quotes), so a text the strict reader took between ``{`` and
``}`` is read the same way, to the same labels, in any line that has it after a name; the name is one the strict
reader took; a value with no space in it and nothing but a number after the one space (``float`` takes it, and no
other blank before it) is what the strict reader's ``[ \\t]+(\\S+)(.*)`` reads. tests/unit/test_pagewrite.py holds
this to the simple path on random and hostile pages, each after the pages before it.

:class:`SeriesCache` keeps the targets, gateway-wide, within a byte budget: least recently used first out, but a
target used in the last minute is never pushed out by a new one (a catch-up cycles through all its targets, and a
cache that evicts in that order would keep nothing); a target not kept is still written with its label sets reused
within the page.
"""

from __future__ import annotations

import math
import struct
import threading
import time
from collections.abc import Mapping
from typing import Final

from gateway import exposition
from gateway.exposition import PageError
from gateway.remotewrite import label, varint

__all__ = ["CACHE_BYTES", "PageError", "SeriesCache", "TargetSeries", "encode_page"]

CACHE_BYTES: Final = 64 << 20  # about 1,500 dcgm-exporter targets (44 KB each)
KEEP_IN_USE: Final = 60.0  # seconds: a target used this recently is not pushed out by a new one
_ENTRY_OVERHEAD: Final = 200  # bytes of Python objects around a kept label set or name (an estimate)

_SERIES_HEADS: dict[int, bytes] = {}  # payload length -> b"\x0a" + its varint (a length is below page size)

# A kept label set: the encoded labels before the name's place, after it (with the head of the sample's field), the
# series' length less the name's and the timestamp's, and whether the name goes in (a page's own __name__ label
# takes its place, as a plain merge lets it).
Entry = tuple[bytes, bytes, int, bool]

# A sample is field 2 of a TimeSeries: its key, its length (10 + the timestamp's varint: one byte), field 1's key,
# the double, field 2's key, the timestamp's varint. The key goes after a label set's bytes; the rest per line.
_SAMPLE_KEY: Final = b"\x12"
_SAMPLE_REST: Final = 1 + 1 + 8 + 1  # its length, field 1's key, the double, field 2's key


def _merge(labels: exposition.Labels, target: Mapping[str, str]) -> dict[str, str]:
    """A page's label of a target label's name becomes ``exported_<name>`` (as Prometheus does); the target's are
    added."""
    merged: dict[str, str] = {}
    for k, v in labels:
        merged[f"exported_{k}" if k in target else k] = v
    merged.update(target)
    return merged


def _series_head(payload: int) -> bytes:
    head = _SERIES_HEADS.get(payload)
    if head is None:
        head = b"\x0a" + varint(payload)
        if payload < 1 << 14:
            _SERIES_HEADS[payload] = head
    return head


class TargetSeries:
    """One target's label sets and metric names, encoded with its labels (filled by :func:`encode_page`)."""

    __slots__ = ("grown", "labels", "last_used", "names", "sets", "size")

    def __init__(self, labels: Mapping[str, str]) -> None:
        self.labels = dict(labels)
        self.sets: dict[str, Entry] = {}  # a line's text from after its "{" to its "}" ("": none) -> the set
        self.names: dict[str, bytes] = {}  # metric name -> its encoded __name__ label
        self.size = 0  # bytes held, as :class:`SeriesCache` counts them
        self.grown = 0  # of which added since the cache last counted
        self.last_used = 0.0

    def entry(self, labels: exposition.Labels, encoded: dict[tuple[str, str], bytes]) -> Entry:
        """A label set's entry; ``encoded`` keeps the labels encoded meanwhile (a page's sets share most)."""
        merged = _merge(labels, self.labels)
        named = "__name__" not in merged
        parts: tuple[list[bytes], list[bytes]] = ([], [])
        for pair in sorted(merged.items()):
            got = encoded.get(pair)
            if got is None:
                got = encoded[pair] = label(*pair)
            parts[named and pair[0] > "__name__"].append(got)
        before, after = b"".join(parts[0]), b"".join(parts[1]) + _SAMPLE_KEY
        return before, after, len(before) + len(after) + _SAMPLE_REST, named

    def keep(self, text: str, entry: Entry) -> None:
        self.sets[text] = entry
        self.grown += len(text) + len(entry[0]) + len(entry[1]) + _ENTRY_OVERHEAD

    def name(self, name: str) -> bytes:
        encoded = self.names.get(name)
        if encoded is None:
            encoded = self.names[name] = label("__name__", name)
            self.grown += len(name) + len(encoded) + _ENTRY_OVERHEAD
        return encoded


def encode_page(page: bytes, series: TargetSeries, ts_ms: int,
                max_samples: int = exposition.MAX_SAMPLES) -> tuple[bytes, int]:
    """The page's samples at ``ts_ms`` with ``series``' labels, as WriteRequest bytes, and how many there are."""
    text = exposition.decode(page)
    lines = text.split("\n")
    if "\r" in text:
        lines = [line.rstrip("\r") for line in lines]
    ts = varint(ts_ms)
    head = b"%c\x09" % (10 + len(ts))  # the sample's length, field 1's key
    tail = b"\x10" + ts  # field 2's key, the timestamp
    sample = struct.Struct(f"<{len(head)}sd{len(tail)}s").pack
    sets, names, heads = series.sets, series.names, _SERIES_HEADS
    parts: list[bytes] = []
    encoded: dict[tuple[str, str], bytes] = {}  # labels read on this page
    count = 0
    for at, line in enumerate(lines):
        if not line or line[0] == "#":
            continue
        # NAME{SET} VALUE, split where it would be if the set is one read before (see the module's docstring).
        before_value, _, value = line.rpartition(" ")
        name, brace, braces = before_value.partition("{")
        entry = sets.get(braces) if braces or not brace else None  # "NAME{ VALUE" is no NAME without labels
        encoded_name = names.get(name)
        v = math.nan
        if entry is not None and encoded_name is not None and not value[:1].isspace():
            try:
                v = float(value)
            except ValueError:
                pass  # the strict reader says why
        if v != v or entry is None or encoded_name is None:
            # A label set, a name or a value that takes the strict reader (NaN too: its spelling matters).
            got = exposition.read_line(line, at + 1)
            if got is None:
                continue  # a line of blanks
            (name, labels, v), end = got
            key = "" if end < 0 else line[len(name) + 1:end + 1]
            entry = sets.get(key)  # a kept set under a new name, say
            if entry is None:
                entry = series.entry(labels, encoded)
                if entry[3]:
                    series.keep(key, entry)
            encoded_name = series.name(name)
        before, after, size, named = entry
        if not named:
            encoded_name = b""
        size += len(encoded_name) + len(ts)
        parts += (heads.get(size) or _series_head(size), before, encoded_name, after, sample(head, v, tail))
        count += 1
        if count > max_samples:
            raise PageError(f"more than {max_samples} samples")
    return b"".join(parts), count


class SeriesCache:
    """Every target's :class:`TargetSeries` within ``max_bytes``, shared by the threads that build requests.

    Two threads may write pages of one target at once (two agents of a pool that both kept it): each entry they
    add is the same for the same text, and a dict's get and set are atomic, so the bytes stay right; the count of
    what the target grew by may then miss an entry (an estimate anyway, ``_ENTRY_OVERHEAD``)."""

    def __init__(self, max_bytes: int = CACHE_BYTES, keep_in_use: float = KEEP_IN_USE) -> None:
        self.max_bytes = max_bytes
        self.keep_in_use = keep_in_use
        self.size = 0
        self._targets: dict[tuple[str, int], TargetSeries] = {}  # least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._targets)

    def target(self, node: str, port: int, labels: Mapping[str, str]) -> TargetSeries:
        """The target's series to encode a page with; :meth:`done` after it."""
        with self._lock:
            got = self._targets.pop((node, port), None)
            if got is not None and got.labels == labels:
                self._targets[(node, port)] = got  # now the most recently used
                return got
            if got is not None:
                self.size -= got.size  # its labels changed (the node moved pool): read afresh
        return TargetSeries(labels)

    def done(self, node: str, port: int, series: TargetSeries) -> None:
        """Count what encoding grew ``series`` by, and keep it if it fits once the targets not used lately are out
        (else it goes: the targets in use stay)."""
        now = time.monotonic()
        key = (node, port)
        with self._lock:
            grown, series.grown = series.grown, 0
            series.size += grown
            series.last_used = now
            held = self._targets.get(key)
            if held is series:
                self.size += grown
            elif held is not None:
                return  # another thread kept its own meanwhile
            else:
                self._targets[key] = series
                self.size += series.size
            while self.size > self.max_bytes:
                oldest_key = next(iter(self._targets))
                oldest = self._targets[oldest_key]
                if now - oldest.last_used < self.keep_in_use:
                    oldest_key, oldest = key, series  # nothing idle to push out: this one goes
                del self._targets[oldest_key]
                self.size -= oldest.size
                if oldest is series:
                    break
