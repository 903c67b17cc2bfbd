"""A node avoids, for a while, the agent it failed through (gateway/avoidance.py), and selection honours it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.avoidance import PATH_FAULTS, Avoidance
from gateway.registry import Registry
from gateway.rendezvous import choose
from raven.protocol import ResetCode


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_hold_doubles_with_each_failure_in_a_row_up_to_its_cap() -> None:
    clock = Clock()
    a = Avoidance(first_hold=15, max_hold=300, clock=clock)
    holds = [a.failed("n1", "agent-a") for _ in range(7)]
    assert holds == [15, 30, 60, 120, 240, 300, 300]
    assert a.avoided("n1") == {"agent-a"}
    assert a.avoided("n2") == frozenset()


def test_the_hold_ends_and_a_success_forgets_the_failures() -> None:
    clock = Clock()
    a = Avoidance(first_hold=15, max_hold=300, clock=clock)
    a.failed("n1", "agent-a")
    clock.now += 16
    assert a.avoided("n1") == frozenset()  # its own agent is tried again
    assert a.failed("n1", "agent-a") == 30  # and failed again: twice as long
    clock.now += 31
    a.succeeded("n1", "agent-a")
    assert len(a) == 0
    assert a.failed("n1", "agent-a") == 15  # a new run of failures starts short


def test_entries_are_bounded_and_the_oldest_go_first() -> None:
    a = Avoidance(max_entries=3, clock=Clock())
    for i in range(5):
        a.failed(f"n{i}", "agent-a")
    assert len(a) == 3
    assert a.avoided("n0") == frozenset() and a.avoided("n1") == frozenset()
    assert a.avoided("n4") == {"agent-a"}


def test_an_entry_long_past_its_hold_is_forgotten_at_the_next_look() -> None:
    clock = Clock()
    a = Avoidance(first_hold=15, max_hold=300, clock=clock)
    a.failed("n1", "agent-a")
    clock.now += 15 + 301
    assert a.avoided("n1") == frozenset()
    assert len(a) == 0


def test_only_faults_of_the_path_count() -> None:
    assert PATH_FAULTS == {ResetCode.CONNECT_FAILED, ResetCode.TIMEOUT}
    assert ResetCode.DRAINING not in PATH_FAULTS and ResetCode.REFUSED not in PATH_FAULTS


@dataclass
class _Tunnel:
    in_flight: int = 0


@dataclass
class _Session:
    agent: str
    usable: bool = True
    session: _Tunnel = field(default_factory=_Tunnel)


@dataclass
class _Entry:
    name: str
    sessions: list[_Session]
    pool: str = "pool-a"


def test_selection_moves_a_node_off_its_failing_agent_and_back_when_none_else_can() -> None:
    registry: Any = Registry()  # selection over stand-in sessions (rendezvous.choose's protocol)
    sessions = [_Session(f"agent-{i}") for i in range(3)]
    entry = _Entry("edge-gpu-7", sessions)
    own = choose(entry.name, sessions)
    assert own is not None
    assert registry.select(entry) is own
    registry.avoidance.failed(entry.name, own.agent)
    other = registry.select(entry)
    assert other is not None and other is not own
    # the retry after the other failed too: back to the node's own agent rather than to nobody...
    for s in sessions:
        if s is not own and s is not other:
            s.usable = False
    assert registry.select(entry, [other]) is own
    # ... and an excluded (already tried) agent is never chosen again, avoided or not
    assert registry.select(entry, [other, own]) is None
    registry.avoidance.succeeded(entry.name, own.agent)
    assert registry.select(entry) is own
