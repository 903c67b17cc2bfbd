"""Per-stream credit flow control, and rate allowances, as pure bookkeeping (no I/O; a clock only passed in).

The receiver of a stream grants the sender ``window`` bytes up front. The sender may
send DATA only while it holds credit; the receiver returns credit with WINDOW frames
as its consumer drains what it buffered. A receiver therefore never buffers more than
``window`` bytes for one stream, and a slow consumer stops only its own stream.
"""

from __future__ import annotations

from raven.protocol.wire import MAX_WINDOW_INCREMENT, ProtocolError, ResetCode


class SendCredit:
    """What this side may still send on one stream."""

    __slots__ = ("available",)

    def __init__(self, initial: int) -> None:
        self.available = initial

    def take(self, wanted: int) -> int:
        """Reserve up to ``wanted`` bytes; returns how many may be sent now (maybe 0)."""
        n = min(wanted, self.available)
        self.available -= n
        return n

    def grant(self, increment: int, stream_id: int) -> None:
        if self.available + increment > MAX_WINDOW_INCREMENT:
            raise ProtocolError(
                f"WINDOW overflow: credit would exceed {MAX_WINDOW_INCREMENT}", stream_id, ResetCode.FLOW_CONTROL
            )
        self.available += increment


class RecvWindow:
    """What the peer may still send on one stream, and when to give credit back."""

    __slots__ = ("credit", "unacked", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.credit = window
        self.unacked = 0

    def received(self, n: int, stream_id: int) -> None:
        if n > self.credit:
            raise ProtocolError(
                f"peer sent {n} bytes with only {self.credit} bytes of credit", stream_id, ResetCode.FLOW_CONTROL
            )
        self.credit -= n

    def consumed(self, n: int) -> int:
        """Record ``n`` bytes handed to the consumer; return a WINDOW increment to send, or 0.

        Credit is returned in batches of at least half a window, so a stream costs one
        WINDOW frame per half window of data rather than one per DATA frame.
        """
        self.unacked += n
        if self.unacked * 2 >= self.window:
            inc = self.unacked
            self.unacked = 0
            self.credit += inc
            return inc
        return 0


class TokenBucket:
    """``rate`` events a second after a ``burst``, with the clock passed in (``now``, seconds)."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = now

    def _refill(self, now: float) -> float:
        tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = max(self.at, now)
        return tokens

    def take(self, now: float) -> bool:
        """Spend one token if there is one; say whether there was."""
        tokens = self._refill(now)
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True

    def reserve(self, now: float) -> float:
        """Spend one token, borrowing it when there is none: how long to wait before the event (0: at once).
        Reservations queue in order: the n-th borrowed token waits n / ``rate``."""
        self.tokens = self._refill(now) - 1.0
        return 0.0 if self.tokens >= 0.0 else -self.tokens / self.rate


class VoidAllowance(TokenBucket):
    """Frames that do nothing (empty DATA, frames for streams that ended or never were) cost the receiver work and
    the sender nothing: a peer may send ``rate`` per second after a ``burst``, then the session ends."""

    __slots__ = ()

    def spend(self, now: float) -> None:
        """Count one such frame; past the allowance, raise a session error (:class:`ProtocolError` on stream 0)."""
        if not self.take(now):
            raise ProtocolError(f"more than {self.rate:.0f} frames per second that do nothing (empty DATA, frames "
                                "for streams that ended or never were)")
