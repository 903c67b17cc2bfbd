"""The simple path from a kept scrape's page to its part of a remote-write request, as gateway/backfill.py wrote it
before gateway/pagewrite.py: every sample parsed (exposition.parse), its labels merged with the target's (a page's
label of a target label's name becomes ``exported_<name>``) and sorted, encoded (remotewrite.encode). The
reference tests/unit/test_pagewrite.py holds pagewrite to, and bench/bench_backfill.py's "before"."""

from __future__ import annotations

from collections.abc import Mapping

from gateway import exposition, remotewrite


def simple_write(page: bytes, target: Mapping[str, str], ts_ms: int,
                 max_samples: int = exposition.MAX_SAMPLES) -> tuple[bytes, int]:
    samples = exposition.parse(page, max_samples)
    series: list[remotewrite.Series] = []
    for name, labels, value in samples:
        merged = {"__name__": name}
        for k, v in labels:
            merged[f"exported_{k}" if k in target else k] = v
        merged.update(target)
        series.append((tuple(sorted(merged.items())), [(ts_ms, value)]))
    return remotewrite.encode(series), len(samples)
