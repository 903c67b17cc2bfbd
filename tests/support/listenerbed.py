"""What the guarded-listener tests share: the event loops they run on, and a CA with a gateway ("gw", for
127.0.0.1) and an agent certificate."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

from raven import pki

Loop = Callable[[], asyncio.AbstractEventLoop]


def loops() -> list[tuple[str, Loop]]:
    """asyncio's loop, and uvloop's where it is installed."""
    found: list[tuple[str, Loop]] = [("asyncio", asyncio.new_event_loop)]
    with contextlib.suppress(ImportError):
        import uvloop

        found.append(("uvloop", uvloop.new_event_loop))
    return found


def listener_pki(d: Path) -> Path:
    pki.create_ca(d)
    pki.issue(d, d, "gateway", "gw", dns_names=["gw"], ip_addresses=["127.0.0.1"])
    pki.issue(d, d, "agent", "agent-1", pools=["pool-a"])
    return d
