"""Samples out of a scraped page (Prometheus text format 0.0.4, and OpenMetrics 1.0's sample lines): strict and
bounded, a :class:`PageError` for anything else.

prometheus_client's parser is the reference (tests/unit/test_backfill_gateway.py checks this one against it) but
takes about 40 ms for one 50 KB dcgm-exporter page, pure Python character by character; a backlog of 1,000 nodes
for 30 minutes is 120,000 pages. This one reads a line with one compiled pattern and its labels with another (a few
ms a page); the gateway reads only the lines whose label sets it has not met before with it (:func:`read_line`),
the others in gateway/pagewrite.py. Comments (``# HELP``, ``# TYPE``, ``# EOF``) are skipped; an OpenMetrics
exemplar (`` # {...}``) is dropped; the page's own timestamps are ignored (the scrape's is used, as Prometheus does
for exporters that send none, dcgm-exporter among them).
"""

from __future__ import annotations

import math
import re
from typing import Final

Labels = tuple[tuple[str, str], ...]
Sample = tuple[str, Labels, float]  # metric name, labels (in page order), value

MAX_SAMPLES: Final = 200_000  # Prometheus's sample_limit is unset by default; a page over this is refused
MAX_LABELS: Final = 64

_PAIR_SRC = r'[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"[^"\\\n]*(?:\\.[^"\\\n]*)*"[ \t]*'
# A sample line: name, an optional label set ("{" pairs separated by commas, one trailing comma allowed "}"), the
# value, and what follows (a timestamp, an exemplar): one match, the pairs then found in the set's text.
_LINE = re.compile(rf'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{[ \t]*((?:{_PAIR_SRC}(?:,[ \t]*{_PAIR_SRC})*,?[ \t]*)?)\}})?'
                   r"[ \t]+(\S+)(.*)")
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\\n]*(?:\\.[^"\\\n]*)*)"')
_TIMESTAMP = re.compile(r"-?[0-9]+(\.[0-9]+)?")
_ESCAPE = re.compile(r"\\(.)")
_ESCAPES: Final = {"n": "\n", "\\": "\\", '"': '"'}


class PageError(ValueError):
    """A page that does not parse (where, and why): the scrape is dropped and counted."""


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value

    def one(m: re.Match[str]) -> str:
        c = m.group(1)
        return _ESCAPES.get(c, "\\" + c)

    return _ESCAPE.sub(one, value)


def _labels(text: str, lineno: int) -> Labels:
    pairs = _PAIR.findall(text)
    if len(pairs) > MAX_LABELS:
        raise PageError(f"line {lineno}: {len(pairs)} labels (limit {MAX_LABELS})")
    if len({k for k, _ in pairs}) != len(pairs):
        raise PageError(f"line {lineno}: a label name repeats")
    return tuple((k, _unescape(v)) for k, v in pairs)


def read_value(text: str, lineno: int) -> float:
    try:
        v = float(text)
    except ValueError:
        raise PageError(f"line {lineno}: value {text[:40]!r} is not a number") from None
    if math.isnan(v) and text.lower() not in ("nan", "+nan", "-nan"):
        raise PageError(f"line {lineno}: value {text[:40]!r} is not a number")
    return v


def decode(page: bytes) -> str:
    try:
        return page.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PageError(f"page is not UTF-8 (byte {exc.start})") from None


def check_tail(rest: str, lineno: int) -> None:
    """What follows the value: ``[timestamp] [# exemplar]``, read past, never used."""
    tail = rest.split()
    if tail and tail[0] != "#":
        if not _TIMESTAMP.fullmatch(tail[0]):
            raise PageError(f"line {lineno}: timestamp {tail[0][:30]!r} is not a number")
        tail = tail[1:]
    if tail and tail[0] != "#":
        raise PageError(f"line {lineno}: unexpected {tail[0][:30]!r} after the value")


def read_line(line: str, lineno: int) -> tuple[Sample, int] | None:
    """One line's sample and where its label set's closing brace is (-1: none); None for a comment or a blank."""
    if not line or line[0] == "#" or line.isspace():
        return None
    m = _LINE.fullmatch(line.rstrip("\r"))
    if m is None:
        raise PageError(f"line {lineno}: not a sample line (name, labels, value)")
    name, labels, value, rest = m.groups()
    check_tail(rest, lineno)
    return (name, _labels(labels, lineno) if labels else (), read_value(value, lineno)), m.end(2)


def parse(page: bytes, max_samples: int = MAX_SAMPLES) -> list[Sample]:
    """The page's samples (gateway/pagewrite.py writes them straight into remote-write bytes, faster, and the
    tests hold it to this)."""
    out: list[Sample] = []
    for lineno, line in enumerate(decode(page).split("\n"), 1):
        got = read_line(line, lineno)
        if got is None:
            continue
        out.append(got[0])
        if len(out) > max_samples:
            raise PageError(f"more than {max_samples} samples")
    return out
