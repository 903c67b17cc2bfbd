"""Counts of things in flight per key (a node, a client, a (client, node) pair), for caps and fair shares.

:class:`KeyedCounter` holds only keys whose count is above zero, so a key's entry goes away with its last
request: a stream of clients that come and go cannot grow it. ``total`` is the sum of all counts. Taking one
away from a key that holds none is a no-op (the count never goes below zero).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


class KeyedCounter(Mapping[K, int]):
    """A read-only mapping of key -> count (above zero), changed with :meth:`add` and :meth:`remove`."""

    __slots__ = ("_counts", "total")

    def __init__(self) -> None:
        self._counts: dict[K, int] = {}
        self.total = 0

    def count(self, key: K) -> int:
        """The key's count (0 for a key that holds none)."""
        return self._counts.get(key, 0)

    def add(self, key: K) -> int:
        """One more for ``key``; returns its new count."""
        n = self._counts.get(key, 0) + 1
        self._counts[key] = n
        self.total += 1
        return n

    def remove(self, key: K) -> int:
        """One fewer for ``key``; returns its new count. A key that reaches zero is forgotten."""
        n = self._counts.get(key, 0)
        if n == 0:
            return 0
        self.total -= 1
        if n == 1:
            del self._counts[key]
            return 0
        self._counts[key] = n - 1
        return n - 1

    def __getitem__(self, key: K) -> int:
        return self._counts[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    def __repr__(self) -> str:
        return f"KeyedCounter({self._counts!r})"
