"""Pages of the ops listener that must not hold the event loop: built in a worker thread, cached, compressed once.

The pattern (the hosts publisher's and /metrics's, in one place): on the event loop, a *snapshot* is taken (copies
of references or small maps, never a walk of the fleet); a worker thread renders the page from it, hashes it (its
ETag) and gzips it; the result is kept under a *key* that says what it was made from (a registry version, a
query), and until ``max_age`` seconds pass or the render's own deadline (``Built.expires``), whichever is first.
Readers that come while a page is being made share that one render. :func:`respond` answers with the gzipped
copy when the client accepts gzip (Prometheus does), and ``304 Not Modified`` when its ``If-None-Match`` still
holds: on the loop, a read of a cached page costs a dictionary lookup and the socket write.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from aiohttp import web

from raven.aio import retrieve_exception
from raven.http.coding import accepts_gzip, gzip_bytes

GZIP_LEVEL = 6  # once per change, in a thread: the size matters more than the CPU (a 1 MB page: ~10 ms at 6)


@dataclass(frozen=True, slots=True)
class Page:
    """One rendered page: its bytes, the same gzipped, and its ETag (weak: the two codings share it)."""

    body: bytes
    gzipped: bytes
    etag: str
    content_type: str

    @classmethod
    def make(cls, body: bytes, content_type: str, level: int = GZIP_LEVEL) -> Page:
        """Hash and gzip ``body`` (in the worker thread: a megabyte takes milliseconds)."""
        digest = hashlib.blake2b(body, digest_size=12).hexdigest()
        return cls(body, gzip_bytes(body, level), f'W/"{digest}"', content_type)


@dataclass(frozen=True, slots=True)
class Built:
    """What a render returns: the page, and until when (``time.monotonic()``) it stays true at the latest."""

    page: Page
    expires: float = float("inf")


Render = Callable[[], Built]  # runs in a worker thread: reads only what the snapshot gave it


class Busy(Exception):
    """Too many different pages are being made at once: the reader is told to come back."""


class PageCache:
    """Pages by key, made in worker threads (see the module's text).

    ``max_age``: seconds a page is served after it was made (0: only shared while it is being made, as /metrics).
    ``size``: pages kept (least recently used dropped) and renders under way at once, at most; a reader asking
    for yet another while ``size`` are being made gets that key's last page, out of date, if one is kept, and
    is refused (:class:`Busy`) otherwise, rather than queueing threads.
    A page is kept per ``key`` (what was asked) with the ``version`` of what it was made from: a page of another
    version replaces it, so that a fleet's churn does not fill the cache with pages nobody will ask for again.
    """

    def __init__(self, max_age: float = 0.0, size: int = 8) -> None:
        self.max_age = max_age
        self.size = size
        self._done: OrderedDict[Hashable, tuple[Built, float, Hashable]] = OrderedDict()  # key -> (built, at, version)
        self._pending: dict[tuple[Hashable, Hashable], asyncio.Future[Built]] = {}  # (key, version) -> render
        self._latest: dict[Hashable, Hashable] = {}  # key -> the version of its newest render under way
        self.renders = 0  # how many renders ran (tests and benchmarks read it)

    def cached(self, key: Hashable, version: Hashable = None, now: float | None = None) -> Page | None:
        """The page kept under ``key`` if it is of ``version`` and still holds."""
        hit = self._done.get(key)
        if hit is None:
            return None
        built, made, made_of = hit
        now = time.monotonic() if now is None else now
        if self.max_age <= 0 or made_of != version or now >= built.expires or now - made >= self.max_age:
            return None
        self._done.move_to_end(key)
        return built.page

    async def get(self, key: Hashable, snapshot: Callable[[], Render], version: Hashable = None) -> Page:
        """The page for ``key`` made of ``version``: kept, being made (shared), or made now from ``snapshot()``
        (called on the loop; it returns the render to run in a worker thread)."""
        page = self.cached(key, version)
        if page is not None:
            return page
        pending = self._pending.get((key, version))
        if pending is None:
            if len(self._pending) >= self.size:
                stale = self._done.get(key)
                if stale is not None:  # this key's last page, out of date: better than none while others render
                    return stale[0].page
                raise Busy(f"{len(self._pending)} pages are being made already")
            self._latest[key] = version
            render = snapshot()
            pending = asyncio.ensure_future(asyncio.to_thread(render))
            pending.add_done_callback(retrieve_exception)  # even when no reader waits for it any more
            pending.add_done_callback(lambda fut: self._finished(key, version, fut))
            self._pending[key, version] = pending
            self.renders += 1
        built = await asyncio.shield(pending)
        return built.page

    def _finished(self, key: Hashable, version: Hashable, fut: asyncio.Future[Built]) -> None:
        if self._pending.get((key, version)) is fut:
            del self._pending[key, version]
        latest = self._latest.get(key)
        if not any(k == key for k, _ in self._pending):
            self._latest.pop(key, None)
        if fut.cancelled() or fut.exception() is not None or self.max_age <= 0 or latest != version:
            return  # failed, or an older version than a render started since: it must not replace a newer page
        self._done[key] = (fut.result(), time.monotonic(), version)
        self._done.move_to_end(key)
        while len(self._done) > self.size:
            self._done.popitem(last=False)

    def clear(self) -> None:
        """Forget the kept pages (what they were made from changed in a way no key says)."""
        self._done.clear()


def _etags(values: list[str]) -> set[str]:
    """The entity tags of If-None-Match header values, compared weakly (RFC 9110 section 13.1.2)."""
    out: set[str] = set()
    for value in values:
        for tag in value.split(","):
            tag = tag.strip()
            out.add(tag.removeprefix("W/"))
    return out


def respond(request: web.Request, page: Page, status: int = 200) -> web.Response:
    """``page`` for this request: gzipped when the client accepts it, 304 when its ETag still holds."""
    headers = {"ETag": page.etag, "Vary": "Accept-Encoding", "Cache-Control": "no-cache"}
    if status == 200:
        tags = _etags(request.headers.getall("If-None-Match", []))
        if tags and ("*" in tags or page.etag.removeprefix("W/") in tags):
            return web.Response(status=304, headers=headers)
    if accepts_gzip(request.headers.getall("Accept-Encoding", [])):
        headers["Content-Encoding"] = "gzip"
        return web.Response(status=status, body=page.gzipped, headers={**headers, "Content-Type": page.content_type})
    return web.Response(status=status, body=page.body, headers={**headers, "Content-Type": page.content_type})


def busy(exc: Busy) -> web.Response:
    return web.Response(status=503, text=f"raven: {exc}; try again in a second\n", headers={"Retry-After": "1"})
