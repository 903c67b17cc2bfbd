"""How pytest-xdist's workers share the suite (scripts/test.sh runs ``pytest -n 2``; the tests wait on real time,
outages, timeouts and scrape intervals, about half of theirs, so two workers on two cores finish in about half).

- Each module runs whole on one worker, so its module-scoped bed (a cluster of real processes) starts once.
- The tests that hold fixed, machine-wide things are grouped by what they hold; a group is one work unit, its
  tests run one at a time on one worker, and the groups are handed out first (the longest units):
  ``netns``: every e2e testbed that builds network namespaces (tests/support/testbed.py, linkbed.py,
  l3testbed.py, layer3.py: fixed namespace names, addresses, veth and TUN device names, iptables and nftables
  rules in them, /run/raven; and the image test, whose podman build compiles the image's modules with mypyc on
  both cores for minutes: beside the layer-3 testbeds' timed failovers and pings it failed them, so it runs in
  their chain, not beside it); ``fixed-ports``: `raven demo` and the README guide (127.0.0.2:9400 both, the
  guide 127.0.0.1:9090 and 10262-10266 too).
- Everything else picks free ports (raven.demo.launch.free_port) on loopback and works in its own tmp_path;
  so do the e2e modules in LOOPBACK_E2E. The previous release's venv is
  built under a file lock (tests/support/release.py).

xdist's own ``--dist loadgroup`` would do this with marks, but its marks change ``item._nodeid``, which pytest 9.2
no longer reads (the groups silently fall apart), so the grouping is a scheduler of its own, chosen by the hook
in tests/conftest.py for every ``--dist`` but ``no`` and ``each``. ``-n 0`` or ``-p no:xdist`` runs serially.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

NETNS = "netns"
FIXED_PORTS = "fixed-ports"
GROUPS = (NETNS, FIXED_PORTS)  # handed out in this order, before any module
FIXED_PORT_FILES = ("tests/e2e/test_guide.py", "tests/integration/test_demo.py")
# e2e modules on loopback only (free ports, own work dirs): modules like any other. A new e2e module is in
# the netns group until it is listed here.
LOOPBACK_E2E = ("tests/e2e/test_dashboards.py", "tests/e2e/test_dns_discovery.py")


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its group, or else its module."""
    module = nodeid.split("::", 1)[0]
    if module in FIXED_PORT_FILES:
        return FIXED_PORTS
    if module.startswith("tests/e2e/") and module not in LOOPBACK_E2E:
        return NETNS
    return module


class ModulesAndGroups(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no type hints
    """xdist's scope scheduling with the scopes of ``unit_of``, the groups handed out first."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        for group in reversed(GROUPS):
            if group in self.workqueue:
                self.workqueue.move_to_end(group, last=False)
        super()._assign_work_unit(node)


def make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
    if config.getvalue("dist") in ("no", "each"):
        return None  # xdist's own (each: every test on every worker, as asked)
    return ModulesAndGroups(config, log)
