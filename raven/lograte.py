"""Logs a peer cannot grow: lines rate-limited per (peer, kind), with a count of what was suppressed.

A hostile or broken peer can trigger the same line thousands of times a second (registration churn, refused
requests, frames for unknown streams, malformed requests). :class:`RateLimitedLog` lets the first one
through, then at most one per interval per key, and says how many were suppressed in between. (What a line
may contain, and how long it may be, is raven/logsafe.py's business.)
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable


class RateLimitedLog:
    """At most one line per ``interval`` for each key; the next one that passes says how many were dropped.

    Keys are bounded too (``max_keys``, least recently used evicted), so that a peer minting new keys
    (new addresses, new names) cannot grow this table without bound; and each kind lets at most
    ``max_per_kind`` lines through per interval across all peers, so that many peers (an IPv6 prefix's worth
    of addresses) cannot either. What a kind's ceiling held back is counted in the next line of that kind.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 60.0,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        max_per_kind: int = 120,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self.max_keys = max_keys
        self.max_per_kind = max_per_kind
        self.clock = clock
        self._seen: OrderedDict[tuple[str, str], list[float]] = OrderedDict()  # key -> [last logged, suppressed]
        self._kinds: dict[str, list[float]] = {}  # kind -> [window start, lines let through, held back by ceiling]

    def allow(self, peer: str, kind: str) -> int | None:
        """None when this (peer, kind) was let through less than ``interval`` ago (the event is counted as
        suppressed); otherwise it is let through now, and the result is how many were suppressed before it."""
        key = (peer[:200], kind[:100])
        now = self.clock()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            self._seen.move_to_end(key)
            return None
        window = self._kinds.get(key[1])
        if window is None or now - window[0] >= self.interval:
            if window is None and len(self._kinds) >= self.max_keys:
                self._kinds.clear()
            window = self._kinds[key[1]] = [now, 0, window[2] if window is not None else 0]
        if window[1] >= self.max_per_kind:
            window[2] += 1
            return None
        window[1] += 1
        suppressed = int(entry[1]) if entry is not None else 0
        suppressed += int(window[2])
        window[2] = 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return suppressed

    def suffix(self, peer: str, suppressed: int) -> str:
        """What a line that got through says about the ones before it that did not."""
        if not suppressed:
            return ""
        return f" ({suppressed} more like it in the last {self.interval:.0f}s not logged)"

    def log(self, level: int, peer: str, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless this (peer, kind) was logged less than ``interval`` ago; True if logged."""
        suppressed = self.allow(peer, kind)
        if suppressed is None:
            return False
        more = self.suffix(peer, suppressed)
        self.logger.log(level, msg + (more.replace("%", "%%") if args else more), *args)
        return True

    def warning(self, peer: str, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, peer, kind, msg, *args)

    def info(self, peer: str, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, peer, kind, msg, *args)
