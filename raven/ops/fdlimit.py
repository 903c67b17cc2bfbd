"""The start-up check of open-file descriptors: what a configuration needs against RLIMIT_NOFILE.

Each service adds up what its configuration may hold open at once (its connection caps and a reserve), raises
its soft limit to the hard one (:func:`raven.http.listener.descriptor_budget`), and says at start, in one
line a person can act on, when the limit is lower than the need. Kubernetes has no field for the limit: it is
the container runtime's (containerd and CRI-O pass their own LimitNOFILE to containers, often 1048576, or a
soft 1024 with a higher hard limit, which the service raises itself); docs/performance.md says how to check and
raise it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from raven.http.listener import descriptor_budget

log = logging.getLogger("raven.fdlimit")

# What an agent holds open besides its connections to nodes and its ops listener: tunnel sessions (one per
# gateway replica), the Kubernetes watch, DNS lookups, certificate and configuration files, layer 3's device.
AGENT_FD_OVERHEAD = 256
UNLIMITED = 1 << 30


@dataclass(frozen=True)
class DescriptorCheck:
    limit: int  # the soft RLIMIT_NOFILE after raising it to the hard one (UNLIMITED when there is none)
    needs: int  # what the configuration adds up to

    @property
    def enough(self) -> bool:
        return self.limit >= self.needs

    def available(self, reserve: int) -> int:
        """Descriptors left beyond ``reserve`` (at least 64)."""
        return max(64, self.limit - reserve)


def needs_message(role: str, needs: dict[str, int], limit: int) -> str:
    total = sum(needs.values())
    parts = " + ".join(f"{n} {what}" for what, n in needs.items())
    return (f"this {role} configuration needs {total} open files ({parts}), and RLIMIT_NOFILE is {limit}: raise it "
            f"to at least {total} (the container runtime's LimitNOFILE, 'ulimit -n' or systemd's LimitNOFILE=; see "
            "docs/performance.md), or lower those settings")


def check_descriptors(role: str, needs: dict[str, int]) -> DescriptorCheck:
    """Raise the soft limit to the hard one, compare it with ``needs`` (what -> descriptors) and say so at start:
    a warning naming the numbers when the limit is lower, an info line otherwise."""
    limit = descriptor_budget(0)
    total = sum(needs.values())
    check = DescriptorCheck(limit, total)
    if not check.enough:
        log.warning("%s", needs_message(role, needs, limit))
    else:
        shown = "unlimited" if limit >= UNLIMITED else str(limit)
        log.info("open files: this %s configuration needs %d, RLIMIT_NOFILE is %s", role, total, shown)
    return check
