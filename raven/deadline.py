"""One request's deadline from the front door to the node's socket: one value, one clock, one unit, one clamp.

The gateway makes it at the front door (``request_timeout``, or Prometheus's scrape timeout when shorter:
gateway/admission.py) and spends it on every wait of the request (gateway/proxy.py). Each OPEN states what is left
of it in the tunnel's contract (:meth:`Deadline.ms`: OPEN's ``deadline_ms`` from protocol version 3, the
``x-raven-timeout-ms`` header before it: raven/protocol/terms.py). The agent makes it again from that when the
OPEN arrives (:meth:`Deadline.stated`, never later than its own ``request_timeout``: agent/checks.py), and its
slot wait and its request spend that one value (agent/forwarder.py): no wait starts a timer of its own.

The clock is ``time.monotonic()``, read here only; seconds inside, whole milliseconds only on the wire, clamped by
the contract's one rule (:func:`raven.protocol.terms.clamp_deadline_ms`). A wait crosses into asyncio as the time
left (:meth:`Deadline.timeout`), so no other clock is ever compared with this one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from raven.protocol.terms import clamp_deadline_ms


@dataclass(frozen=True, slots=True)
class Deadline:
    """When a request must be answered by (``at``, on ``time.monotonic()``), and the ``budget`` in seconds it was
    given when it was made (what a refusal says: "no answer within 10.0s")."""

    at: float
    budget: float

    @classmethod
    def after(cls, budget: float, start: float | None = None) -> Deadline:
        """``budget`` seconds from ``start`` (a ``time.monotonic()`` reading; None: now)."""
        return cls((time.monotonic() if start is None else start) + budget, budget)

    @classmethod
    def stated(cls, deadline_ms: int, own: float) -> Deadline:
        """The deadline an OPEN states (``deadline_ms``; 0: none), from now, never longer than ``own`` seconds
        (the agent's own bound)."""
        budget = min(own, clamp_deadline_ms(deadline_ms) / 1000) if deadline_ms else own
        return cls.after(budget)

    def age(self) -> float:
        """Seconds since it was made (the agent: since the OPEN arrived)."""
        return time.monotonic() - (self.at - self.budget)

    def left(self) -> float:
        """Seconds left (0.0 once it passed)."""
        return max(0.0, self.at - time.monotonic())

    def ms(self) -> int:
        """What is left as the tunnel's contract states it (whole milliseconds, within the contract's bounds)."""
        return clamp_deadline_ms(int(self.left() * 1000))

    def timeout(self) -> asyncio.Timeout:
        """``async with deadline.timeout():`` a wait that ends with ``TimeoutError`` when the deadline passes."""
        return asyncio.timeout(self.left())


NO_DEADLINE = Deadline(0.0, 0.0)  # a record's placeholder until its deadline is made (already passed)
