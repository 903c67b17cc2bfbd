"""The README's first command: `raven demo` works, with uvloop and on the stock event loop."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.integration
@pytest.mark.parametrize("uvloop", [True, False], ids=["uvloop", "stock-asyncio"])
def test_demo(uvloop: bool) -> None:
    env = dict(os.environ)
    if not uvloop:
        env["RAVEN_NO_UVLOOP"] = "1"
    out = subprocess.run([sys.executable, "-m", "raven.cli", "demo"], capture_output=True, text=True, timeout=120,
                         env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    served = [line for line in lines if line.strip().startswith("edge-gpu-") and " 200 " in line]
    assert len(served) == 6 + 3  # every node, then pool factory-a again after the kill
    assert "raven demo: all scrapes succeeded, failover worked." in lines[-1]
    assert "Traceback" not in out.stderr
