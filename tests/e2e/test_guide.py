"""The README's by-hand guide works as written: its shell block runs, command by command, from a clean tree.

The block is taken from README.md (after the ``<!-- guide: ... -->`` marker) and run by bash with
``set -euo pipefail`` in a scratch copy of the files it uses (the project's .venv is linked, so
``bash scripts/setup.sh`` finds everything installed); every background job is stopped afterwards.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import ROOT

MARKER = "<!-- guide: tests/e2e/test_guide.py runs the next block -->"
PORTS = [("127.0.0.1", p) for p in (10262, 10263, 10265, 10266, 9090)] + [("127.0.0.2", 9400)]

pytestmark = pytest.mark.integration


def guide_block() -> str:
    text = (ROOT / "README.md").read_text()
    after = text[text.index(MARKER) + len(MARKER):]
    start = after.index("```sh\n") + len("```sh\n")
    return after[start:after.index("\n```", start)]


def test_the_guide_block_is_there_and_uses_only_shipped_files() -> None:
    block = guide_block()
    for path in ("deploy/examples/local/gateway.yaml", "deploy/examples/local/agent.yaml", "scripts/setup.sh"):
        assert path in block and (ROOT / path).is_file()


def test_the_readme_guide_runs_as_written(tmp_path: Path) -> None:
    for host, port in PORTS:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                pytest.fail(f"{host}:{port} is in use: the guide needs it free")
    if shutil.which("prometheus") is None or shutil.which("curl") is None or shutil.which("openssl") is None:
        pytest.fail("the guide needs prometheus, curl and openssl (scripts/system-deps.sh installs prometheus)")
    work = tmp_path / "clone"
    for rel in ("pyproject.toml", "scripts/setup.sh", "deploy/examples/local/gateway.yaml",
                "deploy/examples/local/agent.yaml"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, work / rel)
    # The guide's `bash scripts/setup.sh` must find Raven installed, and must not touch the project's own
    # virtualenv: a .venv of links to its programs, with the stamp that says "installed".
    shim = work / ".venv"
    (shim / "bin").mkdir(parents=True)
    for entry in (ROOT / ".venv").iterdir():  # pyvenv.cfg and lib/: a python started from here is the venv's
        if entry.name not in ("bin", ".installed", ".installed[dev]"):
            (shim / entry.name).symlink_to(entry)
    for program in (ROOT / ".venv" / "bin").iterdir():
        (shim / "bin" / program.name).symlink_to(program)
    stamp = work / ".venv" / ".installed"
    stamp.touch()
    os.utime(stamp, (os.stat(work / "pyproject.toml").st_mtime + 1,) * 2)
    script = work / "guide.sh"
    script.write_text("set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n" + guide_block() + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEN_")}
    proc = subprocess.Popen(["bash", str(script)], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the guide did not finish within 120 s:\n{out[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert 'DCGM_FI_DEV_GPU_UTIL{gpu="0"' in out and 'DCGM_FI_DEV_GPU_UTIL{gpu="1"' in out, out[-3000:]  # 2 modes
    # raven status: the node's row (NODE POOL STATE REACH AGENTS LAST ...)
    assert re.search(r"^edge-gpu-1 +pool-a +ok +tunnel +agent-pool-a-1 +200 ", out, re.M), out[-3000:]
    assert "127.0.0.1\tedge-gpu-1" in out  # the hosts file
    assert '"job":"edge-dcgm"' in out  # Prometheus has the target up (the grep in the block checks the 1)
