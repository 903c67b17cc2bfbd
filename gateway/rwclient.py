"""Writing remote-write requests to every configured receiver: tokens from files, retries with backoff, and a
request a receiver refuses for good (400: out of bounds, duplicate, bad labels) written again scrape by scrape so
that only the scrapes it refuses are dropped.

Prometheus refuses a whole request for one bad sample (its appender rolls back), so a 400 on a request of many
scrapes says nothing about the others. A 5xx, a 429 or no answer is retried (0.5 s doubling to ``retry_max``)
until it is written or the caller gives up (the batch is then not acknowledged, and the agent keeps it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import aiohttp

from gateway import remotewrite
from raven.config.backfill import GatewayBackfill, Receiver
from raven.lograte import RateLimitedLog

log = logging.getLogger("raven.gateway.backfill")

MAX_ERROR_TEXT = 300


class Refused(Exception):
    """The receiver refused the request for good (400)."""


class Receivers:
    def __init__(self, cfg: GatewayBackfill, on_request: Callable[[str, int], None] | None = None) -> None:
        self.cfg = cfg
        self.on_request = on_request
        self._http: aiohttp.ClientSession | None = None
        self._log = RateLimitedLog(log)

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout))
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    @staticmethod
    def _headers(r: Receiver) -> dict[str, str]:
        headers = dict(remotewrite.HEADERS)
        if r.token_file is not None:
            token = _token(r.token_file)
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    async def post(self, r: Receiver, body: bytes) -> tuple[int, str]:
        """One POST: the status and the start of the answer's text (status 0: no answer, the text says why)."""
        try:
            async with self._client().post(r.url, data=body, headers=self._headers(r)) as resp:
                text = (await resp.content.read(MAX_ERROR_TEXT)).decode("utf-8", "replace").strip()
                return resp.status, text
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return 0, f"{type(exc).__name__}: {str(exc)[:MAX_ERROR_TEXT]}" if str(exc) else type(exc).__name__

    async def _until_written(self, r: Receiver, body: bytes) -> None:
        """Write ``body`` to ``r``, retrying what may pass later; raise :class:`Refused` for a 400."""
        wait = 0.5
        while True:
            status, text = await self.post(r, body)
            if self.on_request is not None:
                self.on_request(r.url, status)
            if 200 <= status < 300:
                return
            if status == 400:
                raise Refused(text)
            self._log.warning(r.url, "write", "remote write to %s failed (%s): retrying in %.1f s", r.url,
                              status or text, wait)
            await asyncio.sleep(wait)
            wait = min(self.cfg.retry_max, wait * 2)

    async def write(self, body: bytes, parts: list[bytes]) -> int:
        """Write one request (``parts``: each scrape's part of it) to every receiver; how many scrapes some
        receiver refused for good (dropped)."""
        refused = 0
        for r in self.cfg.receivers:
            try:
                await self._until_written(r, body)
                continue
            except Refused as exc:
                if len(parts) == 1:
                    self._log.warning(r.url, "refused", "remote write to %s refused one scrape: %s", r.url, exc)
                    refused = max(refused, 1)
                    continue
            n = 0
            for part in parts:
                try:
                    await self._until_written(r, remotewrite.compress(part))
                except Refused as exc:
                    n += 1
                    self._log.warning(r.url, "refused", "remote write to %s refused a scrape: %s", r.url, exc)
            refused = max(refused, n)
        return refused

    async def probe(self) -> list[str]:
        """Write an empty request to each receiver: why each that cannot take one cannot (empty: all can)."""
        problems: list[str] = []
        empty = remotewrite.compress(b"")
        for r in self.cfg.receivers:
            status, text = await self.post(r, empty)
            if 200 <= status < 300:
                continue
            if status == 404:
                problems.append(f"{r.url} answers 404: its Prometheus runs without --web.enable-remote-write-receiver")
            elif status in (401, 403):
                problems.append(f"{r.url} answers {status}: check its token_file")
            elif status == 0:
                problems.append(f"{r.url} is unreachable ({text})")
            else:
                problems.append(f"{r.url} answers {status}: {text[:120]}")
        return problems


def _token(path: Path) -> str:
    try:
        lines = path.read_text().split("\n")
        return lines[0].strip()
    except OSError as exc:
        log.warning("backfill: cannot read token file %s (%s)", path, exc.strerror)
        return ""

