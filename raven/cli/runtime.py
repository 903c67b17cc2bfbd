"""How a long-running `raven` process starts: its logging, its open-files limit, its allocator and its event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any

from raven import logsafe
from raven.http import parsererrors

log = logging.getLogger("raven")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logsafe.install()  # every line redacted, escaped and bounded, whoever wrote it and whatever a peer sent
    parsererrors.install()  # aiohttp's lines about malformed requests: one short line per client and minute
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def raise_fd_limit() -> None:
    """A gateway holds one socket per agent session: lift the soft open-files limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError) as exc:
        log.warning("could not raise the open-files limit: %s", exc)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 128 * 1024


def fix_mmap_threshold() -> None:
    """Keep large allocations in their own mappings (glibc), so an idle TLS session costs little.

    uvloop gives every TLS connection a 256 KiB read buffer of which an idle session touches a
    page or two. glibc's default *dynamic* mmap threshold soon moves such blocks onto the heap,
    where freed and reused pages stay resident; a fixed 128 KiB threshold keeps each in its own
    mapping (untouched pages cost no memory): about 4 KiB less per idle session with 1,000 agents.
    The data path allocates nothing that large: DATA frames are at most 64 KiB, and the guarded
    listeners take TLS bytes as a buffered protocol (uvloop would otherwise allocate 256 KiB per
    decrypted record, each then an mmap/munmap pair). A MALLOC_MMAP_THRESHOLD_ set by the operator
    wins; elsewhere than glibc this does nothing.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is not None and not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
            log.debug("mallopt(M_MMAP_THRESHOLD) was refused")
    except OSError as exc:
        log.debug("cannot set the mmap threshold: %s", exc)


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed, else on the stock event loop."""
    raise_fd_limit()
    try:
        if os.environ.get("RAVEN_NO_UVLOOP"):
            raise ImportError("disabled by RAVEN_NO_UVLOOP")
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return int(uvloop.run(coro))
