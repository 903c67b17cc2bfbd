"""The eviction's choice (raven/http/eviction.py): whom a full ops listener closes to admit a new connection.

Found by issue 29 item 3. The integration test (tests/integration/test_ops_flood.py) floods a real gateway;
these check each rule of the choice on its own, including the many-addresses cases that a loopback flood
covers only in part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

from raven.http.eviction import FEW, Eviction

GRACE = 1.0
_ids = count()


@dataclass(eq=False)
class Conn:
    client: str
    n: int = field(default_factory=lambda: next(_ids))


def held(eviction: Eviction, client: str, n: int, now: float, idle: bool = True) -> list[Conn]:
    conns = [Conn(client) for _ in range(n)]
    for conn in conns:
        eviction.add(conn, now)
        if idle:
            eviction.waiting(conn, now, head=False)
    return conns


def test_the_client_holding_most_loses_its_longest_idle_connection() -> None:
    ev = Eviction(GRACE)
    prometheus = held(ev, "10.0.0.2", 1, now=0.0)
    attacker = held(ev, "10.0.9.1", 64, now=1.0)
    other = held(ev, "10.0.9.2", 63, now=0.5)
    assert ev.victim("10.0.0.3", now=2.0) is attacker[0]  # the kubelet's new connection
    ev.waiting(attacker[0], 3.0, head=True)  # a request begins on it: it waits for its head, not idle any more
    ev.busy(attacker[0])
    assert ev.victim("10.0.0.3", now=3.0) is attacker[1]
    assert ev.victim("10.0.9.3", now=3.0) is attacker[1]  # a new attacker address: the same
    assert prometheus and other and len(ev) == 128


def test_a_connection_being_answered_or_whose_head_is_on_its_way_is_not_taken_while_others_wait() -> None:
    ev = Eviction(GRACE)
    attackers = [held(ev, f"10.1.{i // 250}.{i % 250}", 1, now=5.0)[0] for i in range(510)]
    for conn in attackers[:5]:
        ev.busy(conn)
    kubelet = held(ev, "10.0.0.3", 2, now=10.0, idle=False)  # two probes at once: heads on their way
    ev.busy(kubelet[1])  # one is being answered
    # The kubelet holds the most (2), but has nothing waiting: the connection idle longest elsewhere goes.
    assert ev.victim("10.2.0.1", now=10.1) is attackers[5]
    assert ev.victim("10.0.0.4", now=10.9) is attackers[5]


def test_an_overdue_head_goes_before_an_idle_keep_alive_connection() -> None:
    ev = Eviction(GRACE)
    prometheus = held(ev, "10.0.0.2", 1, now=0.0)
    slow = [held(ev, f"10.1.0.{i}", 1, now=1.0 + i / 100, idle=False)[0] for i in range(5)]
    assert ev.victim("10.0.0.3", now=1.5) is prometheus[0]  # no head is overdue yet
    assert ev.victim("10.0.0.3", now=2.5) is slow[0]  # the oldest overdue head


def test_only_fresh_heads_left_the_oldest_goes_and_a_new_probe_is_the_last() -> None:
    ev = Eviction(GRACE)
    flood = [held(ev, f"10.1.{i // 250}.{i % 250}", 1, now=i / 1000, idle=False)[0] for i in range(511)]
    probe = held(ev, "10.0.0.3", 1, now=0.6, idle=False)[0]
    assert ev.victim("10.2.0.1", now=0.7) is flood[0]
    taken = []
    for i in range(511):  # each newcomer takes the oldest head: the probe's goes only after all 511 older ones
        victim = ev.victim(f"10.3.{i // 250}.{i % 250}", now=0.7)
        assert victim is not None
        taken.append(victim)
        ev.remove(victim)
    assert probe not in taken and ev.victim("10.4.0.1", now=0.7) is probe


def test_no_client_loses_a_connection_to_one_holding_more() -> None:
    ev = Eviction(GRACE)
    held(ev, "10.0.0.2", 1, now=0.0)
    held(ev, "10.0.9.1", 40, now=1.0)
    ev.waiting(held(ev, "10.0.9.2", 1, now=1.0)[0], 1.0, head=False)
    # 10.0.9.1 (40) itself may only displace its own connections, never the one-connection clients.
    victim = ev.victim("10.0.9.1", now=2.0)
    assert victim is not None and victim.client == "10.0.9.1"
    busy = Eviction(GRACE)
    for conn in held(busy, "10.0.9.1", 40, now=1.0):
        busy.busy(conn)
    held(busy, "10.0.0.2", 1, now=0.0)
    assert busy.victim("10.0.9.1", now=2.0) is None  # its own are all busy; the one-connection client stays
    assert busy.victim("10.0.0.5", now=2.0) is not None  # a new client may displace the one holding one


def test_the_counts_follow_the_connections() -> None:
    ev = Eviction(GRACE)
    conns = held(ev, "10.0.0.2", 3, now=0.0)
    ev.busy(conns[0])
    ev.waiting(conns[0], 1.0, head=False)
    ev.busy(conns[1])
    for conn in conns:
        ev.remove(conn)
    assert len(ev) == 0 and ev.holds("10.0.0.2") == 0 and ev.victim("10.0.0.3", now=2.0) is None


def test_a_burst_of_new_connections_from_few_addresses_takes_theirs_not_a_probe_on_its_way() -> None:
    ev = Eviction(GRACE)
    probe = held(ev, "10.0.0.3", 1, now=10.0, idle=False)[0]  # its head is on its way
    burst = [held(ev, f"10.1.0.{i}", 56, now=10.01, idle=False) for i in range(9)]  # all fresh, all newer
    assert ev.victim("10.0.0.4", now=10.05) is burst[0][0]
    assert ev.victim("10.0.0.3", now=10.05) is burst[0][0]  # the kubelet's next probe as well
    assert ev.holds("10.0.0.3") == 1 and probe is not burst[0][0]


def test_slow_heads_from_few_addresses_lose_theirs_before_prometheus_loses_its_idle_connection() -> None:
    # The 9 x 64 slow-head flood (CI of 2026-11-29): every attacker connection sends its head slowly and none is
    # overdue yet, so Prometheus's idle keep-alive connection was the only one "waiting" and was taken.
    ev = Eviction(GRACE)
    prometheus = held(ev, "10.0.0.2", 1, now=0.0)[0]
    flood = [held(ev, f"10.1.0.{i}", 64, now=5.0 + i / 100, idle=False) for i in range(9)]
    for n in range((64 - FEW) * 9):  # down to FEW per address
        victim = ev.victim("10.0.0.3", now=5.5)  # a kubelet's new probe; no head overdue
        assert victim is not None and victim is not prometheus and victim.client.startswith("10.1.0.")
        ev.remove(victim)
        if n == 0:
            assert victim is flood[0][0]  # the heaviest's oldest head on its way
    # Once the flood holds few per address, the order over all applies again (Prometheus's idle goes first).
    assert ev.victim("10.0.0.3", now=5.5) is not None


def test_a_kubelet_firing_its_probes_together_is_not_heavy() -> None:
    ev = Eviction(GRACE)
    probes = held(ev, "10.0.0.3", 3, now=10.0, idle=False)  # startup, liveness, readiness at once
    attackers = [held(ev, f"10.1.{i // 250}.{i % 250}", 1, now=5.0)[0] for i in range(100)]
    assert ev.victim("10.2.0.1", now=10.1) is attackers[0]
    assert all(ev.victim("10.2.0.1", now=10.1) is not p for p in probes)
