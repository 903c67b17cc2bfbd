"""SIGTERM and SIGINT for a service, from the first line of its run: a signal that comes while the service is
still starting is kept and acted on once it has started.

Without this the handlers came after the start-up, and a signal during it (a pod deleted while the agent sets up
layer 3 on a busy node) took the default action: the process died by the signal half set up, its forwarding,
routes and sysctls left behind, with no line in the log. Now the start-up finishes, then the service stops the
ordinary way (draining, then undoing what it set up) and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from types import TracebackType

log = logging.getLogger("raven.signals")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """``with StopSignals(on_stop) as signals: <start>; signals.started(); <serve>``: ``on_stop`` runs once, at
    the first signal once started, or at :meth:`started` when one came during the start-up."""

    def __init__(self, on_stop: Callable[[], None]) -> None:
        self.on_stop = on_stop
        self.pending: signal.Signals | None = None
        self._started = False
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> StopSignals:
        self._loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            self._loop.add_signal_handler(sig, self._signal, sig)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._loop is not None
        for sig in SIGNALS:
            self._loop.remove_signal_handler(sig)

    def _signal(self, sig: signal.Signals) -> None:
        if self._started:
            self._stop()
        elif self.pending is None:
            self.pending = sig
            log.info("%s while starting: stopping once started", sig.name)

    def started(self) -> None:
        self._started = True
        if self.pending is not None:
            self._stop()

    def _stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self.on_stop()
