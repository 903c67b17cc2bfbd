"""The clock check of ``raven check``: this machine, the API server, every gateway replica and every agent agree on
the time within :data:`MAX_SKEW` seconds.

Readings, all against the API server's clock (the cluster's; this machine's when the API server sent no Date):
the API server's ``Date`` header (whole seconds), each replica's ``/status`` ``time`` (its wall clock; the reply's
``Date`` from an older gateway), and each agent's offset from its replica, which the gateway took from the
``Date`` header of the agent's upgrade request when the session opened (``clock_offset_seconds``). Each reading
is good to about a second plus half a round trip: the threshold is well above that.

Why 5 seconds: a machine with working time sync (NTP, chrony, systemd-timesyncd) is within milliseconds, so
5 s means none is running; things break at about a minute (service-account tokens' not-before, certificates
issued a moment ago; Raven's own CA backdates them 5 minutes) and logs of one incident stop lining up much sooner.
"""

from __future__ import annotations

from dataclasses import dataclass

from raven.check.reader import Clock, ClusterView, ReplicaRead
from raven.check.results import Result, failed, passed

MAX_SKEW = 5.0  # seconds
NAME = "clock-skew"
SHOWN = 3


@dataclass(frozen=True)
class Reading:
    who: str  # "agent agent-a-1 (pool site-a, via replica cloud-1)", "gateway replica cloud-1", "this machine"
    offset: float  # seconds ahead (+) or behind (-) the reference


def replica_clock(read: ReplicaRead) -> Clock | None:
    reply, doc = read.reply, read.status or {}
    if reply is None:
        return None
    at = doc.get("time")
    if isinstance(at, int | float) and not isinstance(at, bool):
        return Clock.of(reply.sent, reply.received, float(at), whole_seconds=False)
    return Clock.of(reply.sent, reply.received, reply.date, whole_seconds=True) if reply.date is not None else None


def readings(view: ClusterView, replicas: dict[str, ReplicaRead]) -> tuple[list[Reading], int, str]:
    """Every clock against the reference; how many agent sessions said nothing of their clock; the reference."""
    ref = view.api_clock.offset if view.api_clock is not None else 0.0
    out = [Reading("this machine", -ref)] if view.api_clock is not None else []
    silent = 0
    seen: set[tuple[str, str]] = set()
    for url, read in sorted(replicas.items()):
        clock = replica_clock(read)
        if clock is None or read.status is None:
            continue
        name = str(read.status.get("replica") or url)
        out.append(Reading(f"gateway replica {name}", clock.offset - ref))
        for pool in read.status.get("pools") or []:
            for agent in pool.get("agents") or []:
                key = (name, str(agent.get("session")))
                if key in seen:  # one session serving several pools is listed under each
                    continue
                seen.add(key)
                theirs = agent.get("clock_offset_seconds")
                if not isinstance(theirs, int | float) or isinstance(theirs, bool):
                    silent += 1
                    continue
                out.append(Reading(f"agent {agent.get('agent')} (pool {pool.get('pool')}, via replica {name})",
                                   float(theirs) + clock.offset - ref))
    return out, silent, "the API server's" if view.api_clock is not None else "this machine's"


def clock_skew(view: ClusterView, replicas: dict[str, ReplicaRead]) -> Result:
    found, silent, ref = readings(view, replicas)
    quiet = f"; {silent} agent session(s) did not send their clock (an older release)" if silent else ""
    if not found:
        return failed(NAME, "no clock to compare: neither the API server nor a gateway replica said its time",
                      "see ops-api above")
    off = sorted((r for r in found if abs(r.offset) > MAX_SKEW), key=lambda r: -abs(r.offset))
    if off:
        shown = "; ".join(f"{r.who} is {abs(r.offset):.1f}s {'ahead of' if r.offset > 0 else 'behind'} {ref} "
                          "clock" for r in off[:SHOWN])
        more = f" and {len(off) - SHOWN} more" if len(off) > SHOWN else ""
        return failed(NAME, f"{shown}{more} (more than {MAX_SKEW:g}s){quiet}",
                      "turn time sync on there: timedatectl set-ntp true (then 'timedatectl' says 'System clock "
                      "synchronized: yes'; with chrony: chronyc tracking); an agent's reading is from when its "
                      "session opened: restart it (kubectl -n kube-system rollout restart deploy/raven-agent-POOL) "
                      "to measure again")
    worst = max(found, key=lambda r: abs(r.offset))
    return passed(NAME, f"{len(found)} clocks within {MAX_SKEW:g}s of {ref} (worst: {worst.who}, "
                  f"{worst.offset:+.1f}s){quiet}")
