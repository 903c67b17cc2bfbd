"""One dispatcher for the control frames a service handles (stream 0: REGISTER, REGISTERED, ROUTES, DRAIN, ...).

A table from a frame's type to its handler, shared by every session of a service: each handler gets the
session's context (whatever the service keeps per session) and the frame; a frame with no handler (a HELLO or
WELCOME after the handshake, a REGISTER sent to an agent) goes to ``unexpected``. The core has already acted on
what concerns the session itself (DRAIN moves it to DRAINING, raven/protocol/state.py); the handlers do what
concerns the service.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from raven.protocol import wire

Ctx = TypeVar("Ctx")
F = TypeVar("F", bound=wire.ControlFrame)


class ControlDispatcher(Generic[Ctx]):
    __slots__ = ("_table", "unexpected")

    def __init__(self, unexpected: Callable[[Ctx, wire.ControlFrame], None]) -> None:
        self._table: dict[type[Any], Callable[[Ctx, Any], None]] = {}
        self.unexpected = unexpected

    def on(self, kind: type[F], handler: Callable[[Ctx, F], None]) -> None:
        """Handle frames of type ``kind`` with ``handler`` (one handler per type)."""
        if kind in self._table:
            raise ValueError(f"{kind.__name__} already has a handler")
        self._table[kind] = handler

    def dispatch(self, ctx: Ctx, frame: wire.ControlFrame) -> None:
        handler = self._table.get(type(frame))
        if handler is None:
            self.unexpected(ctx, frame)
        else:
            handler(ctx, frame)
