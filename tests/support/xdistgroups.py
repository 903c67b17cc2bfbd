"""How pytest-xdist's workers share the suite (scripts/test.sh runs ``pytest -n 2``; the tests wait on real time,
outages, timeouts and scrape intervals, about half of theirs, so two workers on two cores finish in about half).

- Each module runs whole on one worker, so its module-scoped bed (a cluster of real processes) starts once.
- The tests that hold fixed, machine-wide things are one work unit, run one at a time on one worker and handed
  out first (the longest unit): every netns testbed in tests/e2e/ (fixed namespace names, addresses, TUN device
  names, iptables and nftables rules, the podman image build under /tmp/raven-podman) and the demo and the README
  guide (fixed ports on 127.0.0.1 and 127.0.0.2:9400). Everything else picks free ports and works in its own
  tmp_path; the previous release's venv is built under a file lock (tests/support/release.py).

xdist's own ``--dist loadgroup`` would do this with marks, but its marks change ``item._nodeid``, which pytest 9.2
no longer reads (the groups silently fall apart), so the grouping is a scheduler of its own, chosen by the hook
in tests/conftest.py for every ``--dist`` but ``no`` and ``each``. ``-n 0`` or ``-p no:xdist`` runs serially.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

MACHINE_WIDE = "machine-wide"
MACHINE_WIDE_DIRS = ("tests/e2e/",)
MACHINE_WIDE_FILES = ("tests/integration/test_demo.py",)  # `raven demo` binds 127.0.0.2-7:9400, as the guide does


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its module, or the one machine-wide unit."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(MACHINE_WIDE_DIRS) or module in MACHINE_WIDE_FILES:
        return MACHINE_WIDE
    return module


class ModulesAndMachineWide(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no type hints
    """xdist's scope scheduling with the scopes of ``unit_of``, the machine-wide unit handed out first."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        if MACHINE_WIDE in self.workqueue:
            self.workqueue.move_to_end(MACHINE_WIDE, last=False)
        super()._assign_work_unit(node)


def make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
    if config.getvalue("dist") in ("no", "each"):
        return None  # xdist's own (each: every test on every worker, as asked)
    return ModulesAndMachineWide(config, log)
