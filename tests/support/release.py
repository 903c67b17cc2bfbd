"""The previous release, built from git history into a virtualenv of its own, for the version-skew tests.

The release's tree is exported from this repository's history at a fixed commit (``git archive``: the same files
a ``git worktree`` at that commit holds, without registering a worktree that a killed test would leave behind)
and pip-installed (not editable) into a virtualenv under a cache directory outside the repository, keyed by
commit and Python version, so that one machine builds it once. A build that did not finish leaves no stamp and is
redone; a cached one is checked (it must still run and report its release) before it is used. On a fresh machine
the build needs the commit in the clone's history and PyPI for the release's dependencies.

Run ``python -m tests.support.release`` to build (or check) it by hand; it prints the interpreter's path.
"""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import ROOT

# The previous release: 0.1.0, the version pyproject.toml carried from the first commit until 0.2.0 (there are no
# tags). This is the last commit of 0.1.0 on main, the one before release announcing began. When a release is
# cut, move these two to the release before it (docs/skew.md, "The previous release").
PREVIOUS_RELEASE = "0.1.0"
PREVIOUS_COMMIT = "ae51ecc3e8eaf8d5573437cb7d37934f3a95cf50"

BUILD_TIMEOUT = 900.0  # seconds for the whole pip install on a cold machine (PyPI downloads included)


class ReleaseBuildError(RuntimeError):
    """The previous release could not be built; the message says why and what to do."""


@dataclass(frozen=True)
class Release:
    version: str
    commit: str
    python: Path  # the release's interpreter

    @property
    def command(self) -> list[str]:
        """How to run its ``raven``: isolated (-I), so that neither PYTHONPATH nor the working directory can put
        this checkout's packages in front of the release's own."""
        return [str(self.python), "-I", "-m", "raven.cli"]


def cache_root() -> Path:
    explicit = os.environ.get("RAVEN_RELEASE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "raven" / "releases"


def _git(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], stdout=stdout, stderr=subprocess.PIPE, timeout=120,
                          check=False)


def _reports(python: Path, version: str) -> bool:
    """Whether the interpreter runs and its raven package is ``version``."""
    if not python.exists():
        return False
    try:
        done = subprocess.run([str(python), "-I", "-c", "import raven; print(raven.__version__)"],
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip() == version


def _export(commit: str, version: str, dest: Path) -> None:
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise ReleaseBuildError(
            f"commit {commit} (release {version}) is not in this clone's history: the skew tests need it "
            "(a shallow clone? run `git fetch --unshallow`)")
    archive = _git("archive", "--format=tar", commit)
    if archive.returncode != 0:
        raise ReleaseBuildError(f"git archive {commit} failed: {archive.stderr.decode(errors='replace')[-500:]}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")


def _build(commit: str, version: str, home: Path, log: Path) -> None:
    shutil.rmtree(home, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="raven-release-src-") as src_dir:
        src = Path(src_dir)
        _export(commit, version, src)
        venv = home / "venv"
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
             str(src)],
        ]
        with log.open("wb") as out:
            for step in steps:
                try:
                    done = subprocess.run(step, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          timeout=BUILD_TIMEOUT, check=False, cwd=src)
                except subprocess.TimeoutExpired:
                    raise ReleaseBuildError(f"building release {version}: {step[2]} took over {BUILD_TIMEOUT:.0f}s"
                                            f" (log: {log})") from None
                if done.returncode != 0:
                    tail = log.read_text(errors="replace")[-2000:]
                    raise ReleaseBuildError(f"building release {version} failed at {' '.join(step[:4])} "
                                            f"(log: {log}):\n{tail}")


def previous_release() -> Release:
    """The previous release, built if it is not cached yet (under a lock: concurrent runs build it once)."""
    return build_release(PREVIOUS_COMMIT, PREVIOUS_RELEASE)


def build_release(commit: str, version: str) -> Release:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = f"{commit[:12]}-{sys.implementation.name}{sys.version_info.major}{sys.version_info.minor}"
    home = root / key
    python = home / "venv" / "bin" / "python"
    stamp = home / "complete"
    with (root / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and _reports(python, version):
            return Release(version, commit, python)
        _build(commit, version, home, root / f"{key}.log")
        if not _reports(python, version):
            raise ReleaseBuildError(f"the venv built from {commit} does not report release {version} "
                                    f"(log: {root / f'{key}.log'})")
        stamp.write_text(f"{commit} {version}\n")
    return Release(version, commit, python)


if __name__ == "__main__":
    print(previous_release().python)
