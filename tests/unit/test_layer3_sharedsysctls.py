"""Forwarding sysctls shared by the Raven processes of one namespace: set by the first, restored by the last."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raven.layer3.sharedsysctls import SharedSysctls

V4, V6 = "net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"


class Kernel:
    """The namespace's sysctls, and which Raven processes run."""

    def __init__(self, **values: str) -> None:
        self.values = {V4: "0", V6: "0", **values}
        self.dead: set[str] = set()

    def process(self, state_dir: Path) -> SharedSysctls:
        return SharedSysctls(self.values.__getitem__, self.values.__setitem__, state_dir=state_dir,
                             namespace="ns-1", alive=self.alive)

    def alive(self, holder: dict[str, Any]) -> bool:
        return holder["id"] not in self.dead


def test_the_last_one_restores_whichever_stops_first(tmp_path: Path) -> None:
    for first_to_stop in (0, 1):
        kernel = Kernel()
        procs = [kernel.process(tmp_path), kernel.process(tmp_path)]
        for p in procs:
            p.acquire([(V4, "1"), (V6, "1")])
        assert kernel.values == {V4: "1", V6: "1"}
        procs[first_to_stop].release()
        assert kernel.values == {V4: "1", V6: "1"}  # the other still forwards, IPv6 too
        assert procs[1 - first_to_stop].release() == [f"{V4}=0", f"{V6}=0"]
        assert kernel.values == {V4: "0", V6: "0"}
        assert list(tmp_path.glob("*.json")) == []  # nothing held, nothing recorded


def test_a_value_on_before_the_first_stays_on(tmp_path: Path) -> None:
    kernel = Kernel(**{V4: "1"})
    a, b = kernel.process(tmp_path), kernel.process(tmp_path)
    a.acquire([(V4, "1"), (V6, "1")])
    b.acquire([(V4, "1")])  # an IPv4-only one
    a.release()
    assert kernel.values == {V4: "1", V6: "0"}  # IPv6 had no other user: back at once
    b.release()
    assert kernel.values == {V4: "1", V6: "0"}


def test_a_crashed_holder_neither_keeps_forwarding_nor_loses_the_value_found(tmp_path: Path) -> None:
    kernel = Kernel()
    crashed, b = kernel.process(tmp_path), kernel.process(tmp_path)
    crashed.acquire([(V4, "1")])
    b.acquire([(V4, "1")])
    kernel.dead.add(crashed.me["id"])  # killed: it never releases
    b.release()
    assert kernel.values[V4] == "0"
    # All crashed: the next one still knows the value found before the first.
    c = kernel.process(tmp_path)
    c.acquire([(V4, "1")])
    kernel.dead.add(c.me["id"])
    d = kernel.process(tmp_path)
    d.acquire([(V4, "1")])
    d.release()
    assert kernel.values[V4] == "0"


def test_a_value_someone_else_changed_is_left_alone(tmp_path: Path) -> None:
    kernel = Kernel()
    a = kernel.process(tmp_path)
    a.acquire([(V4, "1")])
    kernel.values[V4] = "0"  # an administrator switched it off meanwhile
    assert a.release() == []
    b = kernel.process(tmp_path)
    b.acquire([(V4, "1")])
    kernel.values[V4] = "2"
    assert b.release() == [] and kernel.values[V4] == "2"


def test_keep_leaves_forwarding_for_another_tunnel(tmp_path: Path) -> None:
    kernel = Kernel()
    a = kernel.process(tmp_path)
    a.acquire([(V4, "1")])
    assert a.release(keep=True) == [] and kernel.values[V4] == "1"
    assert list(tmp_path.glob("*.json")) == []


def test_a_garbled_record_starts_a_new_one(tmp_path: Path) -> None:
    kernel = Kernel()
    (tmp_path / "layer3-sysctls-ns-1.json").write_text("[not a record")
    a = kernel.process(tmp_path)
    a.acquire([(V4, "1")])
    a.release()
    assert kernel.values[V4] == "0"
