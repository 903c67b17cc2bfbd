"""Configuration reload without a restart: on SIGHUP, and when the configuration file changes.

The new configuration is built exactly as at start (file, environment, flags) and validated; an invalid one
is refused with the same one-line-per-field message, and the configuration in force stays. A valid one is
handed to the service's ``apply``; settings that only a restart can change (listen addresses, identities,
the tunnel's wire limits) are named in a warning and keep their old values until then.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Generic, TypeVar

from pydantic import BaseModel

from raven.errors import ConfigError

log = logging.getLogger("raven.reload")

C = TypeVar("C", bound=BaseModel)


def changed_fields(old: BaseModel, new: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the leaf settings that differ between two configurations of one model."""
    out: list[str] = []
    for name in type(old).model_fields:
        a, b = getattr(old, name), getattr(new, name)
        if isinstance(a, BaseModel) and isinstance(b, BaseModel) and type(a) is type(b):
            out += changed_fields(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append(prefix + name)
    return out


def needs_restart(changed: Iterable[str], restart_only: Iterable[str]) -> list[str]:
    """The changed settings that a running process cannot take over (a prefix matches a whole section)."""
    prefixes = tuple(restart_only)
    return [c for c in changed if c in prefixes or c.startswith(tuple(p + "." for p in prefixes))]


def effective(old: C, new: C, restart_only: Iterable[str]) -> tuple[C, list[str], list[str]]:
    """The configuration to run with after a reload: ``new``, except that settings only a restart can change
    keep their ``old`` values. Returns it, the changed settings taken over, and those held back."""
    changed = changed_fields(old, new)
    held = needs_restart(changed, restart_only)
    if not held:
        return new, changed, []
    tree = new.model_dump()
    before = old.model_dump()
    for dotted in held:
        *parents, leaf = dotted.split(".")
        src, dst = before, tree
        for part in parents:
            src, dst = src[part], dst[part]
        dst[leaf] = src[leaf]
    return type(new).model_validate(tree), [c for c in changed if c not in held], held


class Reloader(Generic[C]):
    """Calls ``load`` on SIGHUP or when ``path`` changes (polled every ``interval``) and ``apply`` on success."""

    def __init__(
        self,
        load: Callable[[], C],
        apply: Callable[[C], None],
        path: Path | None,
        interval: float = 5.0,
    ) -> None:
        self.load = load
        self.apply = apply
        self.path = path
        self.interval = interval
        self._stamp = self._stat()
        self._task: asyncio.Task[None] | None = None
        self.reloads = 0  # successful reloads, for tests and logs
        self.failures = 0

    def _stat(self) -> tuple[int, int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)  # follows the symlinks a ConfigMap volume swaps on update
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload(self, why: str) -> bool:
        try:
            self.apply(self.load())  # apply raises ConfigError before it changes anything
        except ConfigError as exc:
            self.failures += 1
            log.error("configuration reload (%s) refused, the configuration in force stays: %s", why, exc)
            return False
        self.reloads += 1
        log.info("configuration reloaded (%s)", why)
        return True

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload, "SIGHUP")
        if self.path is not None:
            self._task = loop.create_task(self._watch(), name="config-watch")

    async def stop(self) -> None:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            stamp = self._stat()
            if stamp is not None and stamp != self._stamp:
                self._stamp = stamp
                self.reload(f"{self.path} changed")


def take_over(old: C, new: C, restart_only: Iterable[str], logger: logging.Logger) -> tuple[C, list[str]] | None:
    """:func:`effective`, with the log lines a reload owes its operator; None when nothing can be taken over."""
    cfg, changed, held = effective(old, new, restart_only)
    if held:
        logger.warning("configuration reload: %s changed, which takes effect only after a restart", ", ".join(held))
    if not changed:
        logger.info("configuration reload: nothing else changed")
        return None
    return cfg, changed
