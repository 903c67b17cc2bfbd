"""The README's first command: `raven demo` works, with uvloop and on the stock event loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.integration
def test_keep_running_prints_commands_that_work_as_printed(tmp_path: Path) -> None:
    """Every command `raven demo --keep-running` prints runs as printed in a shell whose PATH does not hold the
    virtualenv (scripts/demo.sh runs .venv/bin/raven without putting it on PATH): `raven status ...` too."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and os.path.abspath(p) != os.path.abspath(venv_bin))
    out = tmp_path / "demo.out"
    with out.open("w") as sink:
        demo = subprocess.Popen([sys.executable, "-m", "raven.cli", "demo", "--keep-running"], stdout=sink,
                                stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while "Press Ctrl-C to stop." not in out.read_text():
            assert demo.poll() is None, f"the demo ended ({demo.returncode}):\n{out.read_text()}"
            assert time.monotonic() < deadline, f"the demo did not come up:\n{out.read_text()}"
            time.sleep(0.2)
        text = out.read_text()
        commands = [line.split("   #")[0].strip() for line in text.split("Running. Try:", 1)[1].splitlines()
                    if line.startswith("  ")]
        assert any(" status --gateway " in c for c in commands), text
        for command in commands:
            ran = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30, env=env,
                                 stdin=subprocess.DEVNULL, cwd=tmp_path)
            assert ran.returncode == 0 and ran.stdout.strip(), f"{command!r} -> {ran.returncode}: {ran.stderr}"
            if " status --gateway " in command:
                assert "factory-a" in ran.stdout and "edge-gpu-1" in ran.stdout, ran.stdout
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(timeout=30)
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait()
    assert demo.returncode == 0, out.read_text()
