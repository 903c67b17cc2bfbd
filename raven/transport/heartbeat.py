"""One timer per event loop drives every session's heartbeat (a task per session would cost memory at 1,000s)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol


class Ticking(Protocol):
    heartbeat_interval: float

    @property
    def closed(self) -> bool: ...

    def tick(self, now: float) -> None: ...


class Heartbeats:
    """Visits each session every ``heartbeat_interval`` seconds (checked at a tenth of the smallest interval in
    use), so a silent peer is noticed within ``heartbeat_timeout`` plus one interval."""

    _by_loop: dict[asyncio.AbstractEventLoop, Heartbeats] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sessions: dict[Ticking, float] = {}  # session -> when its next tick is due
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Heartbeats:
        hb = cls._by_loop.get(loop)
        if hb is None or hb.loop.is_closed():
            hb = cls._by_loop[loop] = cls(loop)
        return hb

    def add(self, session: Ticking) -> None:
        self.sessions[session] = self.loop.time() + session.heartbeat_interval
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._run(), name="raven-heartbeats")
        self._wake.set()

    async def _run(self) -> None:
        while self.sessions:
            self._wake.clear()
            step = min(s.heartbeat_interval for s in self.sessions) / 10
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(step):
                    await self._wake.wait()
            now = self.loop.time()
            for session, due in list(self.sessions.items()):
                if session.closed:
                    del self.sessions[session]
                elif now >= due:
                    self.sessions[session] = now + session.heartbeat_interval
                    session.tick(now)
        self._by_loop.pop(self.loop, None)
