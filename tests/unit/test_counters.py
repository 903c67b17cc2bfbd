"""raven/counters.py: per-key counts that forget a key with its last request."""

from __future__ import annotations

from raven.counters import KeyedCounter


def test_counts_per_key_and_in_total() -> None:
    c: KeyedCounter[str] = KeyedCounter()
    assert (c.add("a"), c.add("a"), c.add("b")) == (1, 2, 1)
    assert c == {"a": 2, "b": 1} and c.total == 3 and c.count("a") == 2 and c.count("z") == 0
    assert "a" in c and "z" not in c and len(c) == 2 and sorted(c) == ["a", "b"]


def test_a_key_goes_away_with_its_last_count_and_never_goes_below_zero() -> None:
    c: KeyedCounter[tuple[str, str]] = KeyedCounter()
    c.add(("client", "node"))
    assert c.remove(("client", "node")) == 0
    assert c == {} and c.total == 0 and not c
    assert c.remove(("client", "node")) == 0  # one too many: no negative count, no entry
    assert c == {} and c.total == 0
    c.add(("x", "y"))
    c.add(("x", "y"))
    assert c.remove(("x", "y")) == 1 and c.total == 1 and c == {("x", "y"): 1}
    assert "KeyedCounter" in repr(c)
