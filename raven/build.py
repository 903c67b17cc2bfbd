"""Which modules are compiled with mypyc, and which build of Raven is running.

``COMPILED`` is the one list of compiled modules: setup.py reads it (without importing Raven) and compiles
each with mypyc when it builds (the default: scripts/setup.sh, the image); ``RAVEN_COMPILE=0`` at build time
builds nothing. The modules are plain, mypy-strict Python either way. At run time ``RAVEN_BUILD=pure`` makes
Raven import these modules from their ``.py`` sources even where the compiled ones are installed (raven's
package import calls :func:`prefer_sources`), so the pure build stays importable and testable from the same
install. ``raven --version`` says which one runs (:func:`running`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from types import ModuleType

# The per-scrape path, as far as mypyc handles it. Paths relative to the project's root; no __init__.py.
# Not here, and why: raven/protocol/events.py (mypyc fails at import on its memoryview dataclass fields), and
# raven/transport/pacer.py (its wait's cleanup failed compiled: tests/unit/test_pacer.py). No compiled module
# may hold an async generator (mypyc does not compile them: agent/forwarder.py's RequestBody and
# agent/upstream.py's Slot are classes for that reason), nor bind one name in two ``except`` clauses of different
# types (mypyc types it by the first; tests/unit/test_build.py checks).
COMPILED: tuple[str, ...] = (
    "raven/protocol/wire.py",
    "raven/protocol/frames/base.py",
    "raven/protocol/frames/streams.py",
    "raven/protocol/frames/control.py",
    "raven/protocol/headers.py",
    "raven/protocol/flow.py",
    "raven/protocol/outbox.py",
    "raven/protocol/stream.py",
    "raven/protocol/state.py",
    "raven/protocol/terms.py",
    "raven/protocol/control.py",
    "raven/protocol/connection.py",
    "raven/protocol/handshake.py",
    "raven/protocol/errors.py",
    "raven/protocol/wsframe.py",
    "raven/http/coding.py",
    "raven/transport/tunnel.py",
    "raven/transport/stream.py",
    "raven/transport/websocket.py",
    "raven/http/guard.py",
    "raven/http/clock.py",
    "raven/http/h1.py",
    "raven/http/h1server.py",
    "gateway/request.py",
    "gateway/admission.py",
    "gateway/proxy.py",
    "agent/checks.py",
    "agent/fairslots.py",
    "agent/compress.py",
    "agent/upstreamconn.py",
    "agent/upstream.py",
    "agent/forwarder.py",
)

ENV = "RAVEN_BUILD"  # "pure": import the modules above from their sources


def module_names() -> frozenset[str]:
    return frozenset(path.removesuffix(".py").replace("/", ".") for path in COMPILED)


class _SourcesFirst(MetaPathFinder):
    """Finds the compiled modules' ``.py`` files ahead of their extension modules."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        leaf = fullname.rpartition(".")[2] + ".py"
        for entry in path if path is not None else sys.path:
            source = os.path.join(entry, leaf)
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def prefer_sources() -> None:
    """With RAVEN_BUILD=pure, import the compiled modules' sources (before any of them is imported)."""
    if os.environ.get(ENV, "") == "pure" and not any(isinstance(f, _SourcesFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourcesFirst(module_names()))


def stale(root: str | None = None) -> list[str]:
    """The compiled modules of a source tree (an editable install: each extension beside its source) whose source
    changed since it was built: Python imports the extension first, so an edit would not run until setup.sh builds
    again. Empty for a pure tree. For the tests' start (tests/conftest.py), not for an installed package, whose
    files' times are the installer's."""
    base = root if root is not None else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old = []
    for rel in COMPILED:
        source = os.path.join(base, rel)
        stem = source.removesuffix(".py")
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if os.path.isfile(stem + suffix):
                if os.path.getmtime(source) > os.path.getmtime(stem + suffix):
                    old.append(rel)
                break
    return old


def running() -> str:
    """``compiled`` when the compiled modules are the ones imported, else ``pure``."""
    from raven.protocol import wire

    return "compiled" if (wire.__file__ or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)) else "pure"


if __name__ == "__main__":  # scripts/setup.sh: which sources a rebuild follows
    print("\n".join(COMPILED))
