"""The text exposition of a service's registry (what ``prometheus_client.generate_latest`` writes, byte for byte),
with each sample's name and labels formatted once and kept.

``generate_latest`` formats every sample from scratch at every scrape: the label names checked and escaped, the
values escaped, one ``str.format`` per label; about 16 µs a sample, 5-6 ms of CPU for the gateway's ~350 samples
(prometheus-client 0.26). /metrics is made in a worker thread (raven/ops/server.py), but that thread holds the
interpreter lock the event loop needs for all of it, at every scrape of each Prometheus replica. The samples'
names and labels barely change from one scrape to the next, so this keeps each one's formatted head
(``name{label="value",...}``) and formats only the value. A registry whose names fall outside the classic
character set, or samples with timestamps, are written by ``generate_latest`` itself (none of Raven's do).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.registry import Collector

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_SUFFIXES = ("_created", "_gsum", "_gcount")  # OpenMetrics samples, written as gauges of their own at the end
_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
MAX_HEADS = 20_000  # formatted heads kept at most (labels that come and go: pools, certificate subjects)


class _Unusual(Exception):
    """A name or a sample this writer leaves to ``generate_latest``."""


def _value(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    """What prometheus_client.utils.floatToGoString writes (the tests compare them)."""
    text = repr(float(value))
    if "n" in text:  # inf, -inf, nan
        return "+Inf" if text == "inf" else "-Inf" if text == "-inf" else "NaN"
    dot = text.find(".")
    if dot <= 6 or value <= 0:
        return text
    mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")  # Go writes exponents sooner than Python
    return f"{mantissa}e+{dot - 1:02d}"


def _doc(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class Exposition:
    """``generate_latest(registry)`` for one registry, its samples' heads kept between calls (thread-safe: the
    kept map only grows, and a lost race formats a head twice)."""

    def __init__(self, registry: Collector) -> None:
        self.registry = registry
        self._heads: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}

    def _head(self, name: str, labels: dict[str, str]) -> str:
        key = (name, tuple(labels.items()))
        head = self._heads.get(key)
        if head is None:
            if not _NAME.match(name) or not all(_LABEL.match(k) for k in labels):
                raise _Unusual(name)
            inner = ",".join(f'{k}="{_value(v)}"' for k, v in sorted(labels.items()))
            head = f"{name}{{{inner}}}" if inner else name
            if len(self._heads) >= MAX_HEADS:
                self._heads = {}
            self._heads[key] = head
        return head

    def _family(self, name: str, kind: str, doc: str, lines: Iterable[str], out: list[str]) -> None:
        if not _NAME.match(name):
            raise _Unusual(name)
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")
        out.extend(lines)

    def render(self) -> bytes:
        try:
            return self._render()
        except _Unusual:
            return generate_latest(self.registry)

    def _render(self) -> bytes:
        out: list[str] = []
        head, gvalue = self._head, _number
        for metric in self.registry.collect():
            name, kind, doc = metric.name, metric.type, _doc(metric.documentation)
            shown = name + "_total" if kind == "counter" else name + "_info" if kind == "info" else name
            lines: list[str] = []
            extra: dict[str, list[str]] = {}
            for s in metric.samples:
                if s.timestamp is not None:  # (exemplars: this format has none; generate_latest drops them too)
                    raise _Unusual(s.name)
                line = f"{head(s.name, s.labels)} {gvalue(s.value)}\n"
                if s.name.startswith(name) and s.name[len(name):] in _SUFFIXES:
                    extra.setdefault(s.name[len(name):], []).append(line)
                else:
                    lines.append(line)
            self._family(shown, _TYPES.get(kind, kind), doc, lines, out)
            for suffix, more in sorted(extra.items()):
                self._family(name + suffix, "gauge", doc, more, out)
        return "".join(out).encode()
