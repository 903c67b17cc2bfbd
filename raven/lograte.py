"""Logs a peer cannot grow: warnings rate-limited per (peer, kind) with a count, and lines bounded in size.

A hostile or broken peer can trigger the same warning thousands of times a second (registration churn,
frames for unknown streams, malformed requests). :class:`RateLimitedLog` lets the first one through, then
at most one per interval per key, and says how many were suppressed in between. :class:`BoundedLines`
is a logging filter that cuts every record's message to a maximum length, whatever was interpolated.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_LINE = 2000  # characters of one log message, after interpolation


class RateLimitedLog:
    """At most one line per ``interval`` for each key; the next one that passes says how many were dropped.

    Keys are bounded too (``max_keys``, least recently used evicted), so that a peer minting new keys
    (new addresses, new names) cannot grow this table without bound.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 60.0,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self.max_keys = max_keys
        self.clock = clock
        self._seen: OrderedDict[tuple[str, str], list[float]] = OrderedDict()  # key -> [last logged, suppressed]

    def log(self, level: int, peer: str, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless this (peer, kind) was logged less than ``interval`` ago; True if logged."""
        key = (peer[:200], kind[:100])
        now = self.clock()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            self._seen.move_to_end(key)
            return False
        suppressed = int(entry[1]) if entry is not None else 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        if suppressed:
            msg += f" ({suppressed} more like it from {peer} in the last {self.interval:.0f}s not logged)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, peer: str, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, peer, kind, msg, *args)

    def info(self, peer: str, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, peer, kind, msg, *args)


class BoundedLines(logging.Filter):
    """Cuts each record's message to ``limit`` characters (peer-chosen text cannot make a line huge)."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a bad format string must not lose the record
            text = f"{record.msg!r} % {record.args!r}"
        if len(text) > self.limit:
            record.msg = text[: self.limit] + f"... [{len(text) - self.limit} characters cut]"
            record.args = ()
        return True
