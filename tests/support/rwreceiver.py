"""A remote-write receiver for tests: decodes what it is sent (gateway/remotewrite.py's reader), checks the token,
keeps the samples, and answers as it is told (a status to return, or a pause)."""

from __future__ import annotations

from aiohttp import web

from gateway import remotewrite
from raven.demo.launch import free_port

Labels = tuple[tuple[str, str], ...]


class Receiver:
    def __init__(self, token: str = "", host: str = "127.0.0.1") -> None:
        self.token = token
        self.host = host
        self.port = free_port(host)
        self.samples: dict[Labels, dict[int, float]] = {}  # series -> ts_ms -> value
        self.requests = 0
        self.status = 204  # what to answer (a test sets 500 or 400)
        self.refuse_metric = ""  # a 400 for any request holding this metric name
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/api/v1/write"

    async def _write(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.Response(status=401, text="bad token")
        if request.headers.get("Content-Encoding") != "snappy":
            return web.Response(status=400, text="not snappy")
        series = remotewrite.decode(remotewrite.decompress(await request.read()))
        if self.status >= 300:
            return web.Response(status=self.status, text="told to fail")
        if self.refuse_metric and any(dict(labels).get("__name__") == self.refuse_metric for labels, _ in series):
            return web.Response(status=400, text="out of bounds")
        for labels, samples in series:
            assert list(labels) == sorted(labels), "labels must be sorted"
            self.samples.setdefault(labels, {}).update(samples)
        return web.Response(status=204)

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/api/v1/write", self._write)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def of(self, **match: str) -> dict[Labels, dict[int, float]]:
        return {k: v for k, v in self.samples.items() if all(dict(k).get(n) == m for n, m in match.items())}
