"""What the views (/sd, /status, /nodes) read of the registry: immutable copies a worker thread may read while the
event loop goes on changing the registry (gateway/registry.py makes them)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["NodeView", "RefusedClaim"]


class NodeView(NamedTuple):
    """One node as the views (/sd, /status, /nodes) show it: an immutable copy, rebuilt only when it changes, that
    a worker thread may read while the event loop goes on changing the registry."""

    name: str
    pool: str
    address: str
    agents: tuple[str, ...]  # sorted; empty: no session holds it now
    released_at: float | None  # time.monotonic() when its last session left


class RefusedClaim(NamedTuple):
    """A node an agent's latest registration listed and the gateway refused (the status page lists it)."""

    name: str
    pool: str
    agent: str
    reason: str
    at: float  # wall clock
