"""A kept batch's scrapes, checked, as remote-write requests (CPU only: it runs in the catch-up's worker process,
gateway/catchupworker.py).

Checked: only nodes of the session's own pool at ports with a job; pages within ``max_page`` that parse
(gateway/pagewrite.py); samples within ``max_age`` and ``max_future`` of now; the labels the scrape configuration
gives the target (job, instance, node, pool; a page's own label of that name becomes ``exported_<name>``, as
Prometheus does). What is dropped is counted by reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway import exposition, pagewrite, remotewrite
from raven.backfill import pages
from raven.config.backfill import GatewayBackfill
from raven.protocol import backfill as bf


@dataclass(slots=True)
class Request:
    """One remote-write request: its body (snappy), and each scrape's part of the message (WriteRequest is a
    repeated field: the parts joined are the message), to write them one by one when a receiver refuses it."""

    body: bytes
    parts: list[bytes]
    samples: int


@dataclass(frozen=True, slots=True)
class BuildSettings:
    """What of the configuration the build needs: plain data, to cross to the worker process."""

    jobs: dict[int, str]
    target_labels: tuple[str, ...]
    max_age: float
    max_future: float
    max_page: int
    samples_per_request: int

    @classmethod
    def of(cls, cfg: GatewayBackfill) -> BuildSettings:
        return cls(dict(cfg.jobs), tuple(cfg.target_labels), cfg.max_age, cfg.max_future, cfg.max_page,
                   cfg.samples_per_request)


def _target_labels(cfg: BuildSettings, job: str, node: str, port: int, pool: str) -> dict[str, str]:
    every = {"job": job, "instance": f"{node}:{port}", "node": node, "pool": pool, "port": str(port)}
    return {k: every[k] for k in cfg.target_labels}


def last_seq(entries: Iterable[bf.Entry]) -> int:
    return max((e.seq for e in entries if isinstance(e, bf.Scrape)), default=0)


class Builder:
    """A batch's scrapes, checked, as remote-write requests one at a time. ``pool_of(node)`` is the node's pool
    when it is one of the session's own, else None; ``series`` what the targets' earlier pages taught
    (gateway/pagewrite.py)."""

    def __init__(self, entries: list[bf.Entry], cfg: GatewayBackfill | BuildSettings,
                 pool_of: Callable[[str], str | None], now_ms: int,
                 series: pagewrite.SeriesCache | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, BuildSettings) else BuildSettings.of(cfg)
        self.series = pagewrite.SeriesCache() if series is None else series
        self.pool_of = pool_of
        self.now_ms = now_ms
        self.dropped: dict[str, int] = {}  # reason -> scrapes
        self.last_seq = last_seq(entries)
        self._entries = entries
        self._at = 0
        self._keys: dict[int, bytes] = {}

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def next(self) -> Request | None:
        cfg = self.cfg
        parts: list[bytes] = []
        samples = 0
        while self._at < len(self._entries):
            e = self._entries[self._at]
            if isinstance(e, bf.Key):
                self._at += 1
                if self.pool_of(e.node) is not None:
                    try:
                        self._keys[e.key] = pages.decompress_key(e.blob, cfg.max_page)
                    except pages.PageError:
                        pass  # its scrapes are dropped as "bad-page"
                continue
            parsed = self._scrape(e)
            if parsed is None:
                self._at += 1
                continue
            part, n = parsed
            if parts and samples + n > cfg.samples_per_request:
                break  # this scrape starts the next request
            self._at += 1
            parts.append(part)
            samples += n
        if not parts:
            return None
        return Request(remotewrite.compress(b"".join(parts)), parts, samples)

    def _scrape(self, e: bf.Scrape) -> tuple[bytes, int] | None:
        """The scrape's part of a WriteRequest and its samples, or None when it is dropped."""
        cfg = self.cfg
        pool = self.pool_of(e.node)
        job = cfg.jobs.get(e.port)
        if pool is None:
            self._drop("node")
        elif job is None:
            self._drop("port")
        elif e.ts_ms > self.now_ms + cfg.max_future * 1000:
            self._drop("future")
        elif e.ts_ms < self.now_ms - cfg.max_age * 1000:
            self._drop("too-old")
        elif (key := self._keys.get(e.key)) is None:
            self._drop("bad-page")
        else:
            try:
                page = key if not e.blob else pages.decompress(e.blob, key, cfg.max_page)
                series = self.series.target(e.node, e.port, _target_labels(cfg, job, e.node, e.port, pool))
                try:
                    return pagewrite.encode_page(page, series, e.ts_ms)
                finally:
                    self.series.done(e.node, e.port, series)
            except (pages.PageError, exposition.PageError):
                self._drop("bad-page")
        return None
