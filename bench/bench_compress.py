"""Benchmark: what gzip before the uplink costs the agent and saves the tunnel, per scrape of one page.

Pages shaped like dcgm-exporter's (raven/demo/simexporter.py: fixed labels per GPU, ~50 KB for 8 GPUs),
compressed with agent/compress.py's encoder as the agent does it (the page in pieces of --piece bytes, as
the node's socket delivers them). Prints, per page size, library (ISA-L's deflate, which the agent uses, and
the standard library's zlib) and level, the bytes on the wire as a share of the page and the CPU time per page
(the best of --repeat rounds of --number pages, process time).

    .venv/bin/python bench/bench_compress.py

This is a benchmark, not a test: the CPU figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from typing import Any

from agent.compress import Gzip

try:
    from isal import isal_zlib
except ImportError:  # the agent then uses zlib too
    isal_zlib = None
from raven.demo.simexporter import render_metrics


def per_page(page: bytes, library: Any, level: int, piece: int, number: int, repeat: int) -> tuple[int, float]:
    pieces = [page[i:i + piece] for i in range(0, len(page), piece)]
    wire = 0
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(number):
            gz = Gzip(level, library)
            for i, chunk in enumerate(pieces):
                gz.feed(chunk, last=i == len(pieces) - 1)
        best = min(best, (time.process_time() - start) / number)
        wire = gz.wire
    return wire, best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16], help="GPUs per page (default 8 16)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 3, 6],
                        help="levels (default 1 3 6; ISA-L has 0-3, so 6 is zlib's only)")
    parser.add_argument("--piece", type=int, default=16 * 1024, help="bytes per piece from the node (default 16384)")
    parser.add_argument("--number", type=int, default=200, help="pages per round (default 200)")
    parser.add_argument("--repeat", type=int, default=7, help="rounds; the best is printed (default 7)")
    args = parser.parse_args()
    libraries: list[tuple[str, Any]] = [("zlib", zlib)]
    if isal_zlib is not None:
        libraries.insert(0, ("isal", isal_zlib))
    print(f"{'gpus':>4} {'page B':>8} {'lib':>5} {'level':>5} {'wire B':>8} {'wire %':>7} {'cpu ms/page':>11}")
    for gpus in args.gpus:
        page = render_metrics("edge-gpu-7", gpus=gpus)
        for name, library in libraries:
            for level in args.levels:
                if name == "isal" and level > 3:
                    continue
                wire, cpu = per_page(page, library, level, args.piece, args.number, args.repeat)
                print(f"{gpus:>4} {len(page):>8} {name:>5} {level:>5} {wire:>8} {100 * wire / len(page):>6.1f}% "
                      f"{cpu * 1000:>11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
