"""Publishing the hosts file (raven/dns/hosts.py renders it, raven/dns/shards.py splits it): re-rendered after
changes, debounced, in a worker thread, to each sink (a file, a ConfigMap) with a deadline and a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path

from raven.aio import cancel_and_wait, retrieve_exception
from raven.dns.hosts import check_names, render_checked, service_addresses
from raven.dns.shards import render_shards_checked
from raven.errors import RavenError

log = logging.getLogger("raven.hosts")

SINK_TIMEOUT = 30.0  # seconds one sink (a file, a ConfigMap) may take to publish before it counts as failed


def write_atomic(path: Path, content: str) -> bool:
    """Write ``content`` to ``path`` through a temporary file and a rename; only if it changed.

    A crash at any point leaves either the old file or the new one, never a partial one.
    Returns True when the file was written.
    """
    try:
        if path.read_text() == content:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return True


Sink = Callable[[str], Awaitable[bool]]


class HostsPublisher:
    """Re-render and publish after changes, debounced: a burst of registrations is one write.

    With ``shards`` > 1 the names are split (see :mod:`raven.dns.shards`) and each sink is given the file of
    its shard: ``sinks`` are (label, shard, sink).

    A render runs in a worker thread: on the event loop, ``names()`` and ``direct()`` are only copied (a snapshot:
    the registry is never read from another thread); ``select``, sorting, checking and writing the files run in the
    thread, so that 100,000 names hold the loop for the snapshot and the GIL's switch interval, not for the render.
    """

    def __init__(self, names: Callable[[], Iterable[str]], addresses: Sequence[str], debounce: float,
                 sinks: Sequence[tuple[str, int, Sink]], ready: Callable[[], bool] | None = None,
                 shards: int = 1, direct: Callable[[], Mapping[str, str]] | None = None,
                 select: Callable[[list[str]], list[str]] | None = None) -> None:
        self.names = names
        # Which of the valid names to publish (sorted, unique): run in the worker thread, so it must read nothing
        # the event loop changes in place.
        self.select = select
        self.direct = direct or dict
        self.addresses = list(addresses)
        self.debounce = debounce
        self.sinks = list(sinks)
        self.shards = shards
        # Nothing is published before ``ready()``: a restarted gateway knows no nodes until its agents
        # are back, and publishing then would take every edge name out of DNS for a while.
        self.ready = ready or (lambda: True)
        self.content = ""
        self.writes = 0
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._skipped: set[str] = set()
        self._failures = 0

    def changed(self) -> None:
        self._dirty.set()

    def snapshot(self) -> tuple[list[str], dict[str, str], list[str]]:
        """What a render needs, copied on the event loop: the registry is never read from another thread."""
        return list(self.names()), dict(self.direct()), list(self.addresses)

    def render_snapshot(self, names: list[str], direct: dict[str, str], addresses: list[str],
                        shards: int) -> tuple[list[str], list[str]]:
        """The files of ``shards`` shards (one: the whole file) and the names left out; reads only its arguments
        and ``select``, so that it runs in a worker thread."""
        valid, skipped = check_names(names)
        if self.select is not None:
            valid = self.select(valid)
        ordered = service_addresses(addresses)
        if shards > 1:
            return render_shards_checked(valid, ordered, shards, direct=direct), skipped
        return [render_checked(valid, ordered, direct=direct)], skipped

    def _note_skipped(self, skipped: Iterable[str]) -> None:
        """Log each name the hosts format cannot carry once (on the event loop)."""
        for name in skipped:
            if name not in self._skipped:
                self._skipped.add(name)
                log.warning("node name %r is not a valid RFC 1123 host name: left out of the hosts file", name[:300])

    async def render(self, shards: int | None = None) -> list[str]:
        """The files of ``shards`` shards (default: the publisher's), rendered in a worker thread on a snapshot taken
        here: a render of 100,000 names holds the event loop only for the snapshot and the GIL's switch interval."""
        snap = self.snapshot()
        contents, skipped = await asyncio.to_thread(self.render_snapshot, *snap, shards=shards or self.shards)
        self._note_skipped(skipped)
        return contents

    async def publish_once(self) -> bool:
        """Publish to every sink; False when something failed (and will be retried)."""
        if not self.ready():
            return False
        contents = await self.render()
        self.content = contents[0] if len(contents) == 1 else "".join(contents)
        ok = True
        for label, shard, sink in self.sinks:
            content = contents[shard] if shard < len(contents) else contents[0]
            try:
                async with asyncio.timeout(SINK_TIMEOUT):  # one stuck sink must not hold back the others for ever
                    written = await sink(content)
                if written:
                    self.writes += 1
                    log.info("published hosts file (%d line(s)) to %s", content.count("\n") - 3, label)
            except TimeoutError:
                log.warning("could not publish the hosts file to %s: no answer within %.0fs", label, SINK_TIMEOUT)
                ok = False
            except Exception as exc:  # retried with backoff
                log.warning("could not publish the hosts file to %s: %s", label, exc)
                ok = False
        return ok

    async def run(self, resync: float = 60.0) -> None:
        """Publish once ready (looked at every second until then), then after every change (debounced), every
        ``resync`` seconds anyway, and with exponential backoff (up to 30 s) while publishing fails."""
        while True:
            self._dirty.clear()
            if not self.ready():
                wait = 1.0  # not a failure: published within a second of becoming ready
            elif await self.publish_once():
                self._failures = 0
                wait = resync
            else:
                self._failures += 1
                wait = min(30.0, self.debounce * 2 ** min(self._failures, 8))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._dirty.wait()
            await asyncio.sleep(self.debounce)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="hosts-publisher")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None


class SinkBusy(RavenError, OSError):
    """The previous write to a file is still running (a hung mount): not another thread stuck behind it."""


def file_sink(path: Path) -> Sink:
    """Write the file in a worker thread. A write that outlives the publisher's deadline (a hung NFS or FUSE
    mount) keeps its thread, which cannot be stopped: while it runs, later writes to the same file are refused
    (retried with the publisher's backoff) rather than each stranding one more of the shared worker threads."""
    pending: list[asyncio.Future[bool]] = []

    async def write(content: str) -> bool:
        if pending and not pending[0].done():
            raise SinkBusy(f"the previous write to {path} has not finished (is its file system stuck?)")
        fut = asyncio.get_running_loop().run_in_executor(None, write_atomic, path, content)
        fut.add_done_callback(retrieve_exception)  # its error is logged by the caller, or by nobody once given up on
        pending[:] = [fut]
        return await asyncio.shield(fut)

    return write
