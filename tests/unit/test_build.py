"""The compiled and the pure build: the same answers to the same bytes, and a switch between them that works."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raven import build
from tests.support.paths import ROOT

SEEDS = (1, 2, 3)
PER_SEED = 2000


def _python(code_or_args: list[str], pure: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != build.ENV}
    if pure:
        env[build.ENV] = "pure"
    done = subprocess.run([sys.executable, *code_or_args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_raven_build_pure_imports_every_listed_module_from_its_source() -> None:
    names = sorted(build.module_names())
    code = ("import importlib, json; from raven import build; "
            f"print(json.dumps([build.running(), [importlib.import_module(n).__file__ for n in {names!r}]]))")
    running, files = json.loads(_python(["-c", code], pure=True))
    assert running == "pure"
    assert len(files) == len(build.COMPILED) and all(f.endswith(".py") for f in files), files
    assert "pure build" in _python(["-m", "raven.cli", "--version"], pure=True)


def test_version_names_the_build_that_runs() -> None:
    out = _python(["-m", "raven.cli", "--version"], pure=build.running() == "pure")
    assert f"; {build.running()} build)" in out


def test_compiled_and_pure_codec_and_core_agree_on_fuzzed_bytes() -> None:
    from raven.protocol import wire

    if not (wire.__file__ or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        pytest.skip("this is the pure build (RAVEN_BUILD=pure, or built with RAVEN_COMPILE=0): nothing to compare")
    for seed in SEEDS:
        args = ["-m", "tests.support.codecfuzz", str(seed), str(PER_SEED)]
        compiled, pure = json.loads(_python(args, pure=False)), json.loads(_python(args, pure=True))
        assert (compiled["build"], pure["build"]) == ("compiled", "pure")
        raised = sum(1 for r in pure["results"] if r[1][0] == "raised")
        assert 0.2 * PER_SEED < raised < 0.9 * PER_SEED  # both valid frames and errors were exercised
        for c, p in zip(compiled["results"], pure["results"], strict=True):
            assert c == p, f"seed {seed}: the builds differ on {c[0]}"


def test_a_compiled_module_older_than_its_source_is_named(tmp_path: Path) -> None:
    """tests/conftest.py refuses to test a tree whose compiled module predates an edit of its source."""
    rel = build.COMPILED[0]
    source = tmp_path / rel
    source.parent.mkdir(parents=True)
    source.write_text("x = 1\n")
    ext = source.with_name(source.stem + importlib.machinery.EXTENSION_SUFFIXES[0])
    ext.write_bytes(b"")
    os.utime(source, (1000, 1000))
    os.utime(ext, (2000, 2000))
    assert build.stale(str(tmp_path)) == []  # built after its source
    os.utime(source, (3000, 3000))
    assert build.stale(str(tmp_path)) == [rel]  # edited since
    ext.unlink()
    assert build.stale(str(tmp_path)) == []  # a pure tree


_AGENT_TEXTS = """
import errno, importlib.machinery, json
import raven  # first, as raven.cli is: its import applies RAVEN_BUILD=pure
from agent import forwarder as f
errors = [OSError(errno.ECONNREFUSED, "Connection refused"), OSError("connect to 10.0.0.7:9400 failed"),
          ConnectionResetError(), ValueError("at 10.0.0.7\\nAuthorization: Bearer secret"), RuntimeError("x" * 999)]
print(json.dumps({
    "compiled": (f.__file__ or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)),
    "status": [f._odd_status(s) for s in range(-1, 1001)],
    "safe": [f._safe(e, a) for e in errors for a in ("", "10.0.0.7")],
    "os": [f._os_reason(e, "10.0.0.7") for e in errors if isinstance(e, OSError)],
}))
"""


def test_compiled_and_pure_agent_tell_the_gateway_the_same() -> None:
    """agent/forwarder.py (compiled since issue 31): which node statuses are refused and why, and an error's text
    with the node's address masked, alike in both builds."""
    from agent import forwarder

    if not (forwarder.__file__ or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        pytest.skip("agent/forwarder.py runs from its source here: nothing to compare")
    compiled, pure = json.loads(_python(["-c", _AGENT_TEXTS], pure=False)), json.loads(_python(["-c", _AGENT_TEXTS],
                                                                                                pure=True))
    assert (compiled.pop("compiled"), pure.pop("compiled")) == (True, False)
    assert compiled == pure
    assert sum(1 for why in pure["status"] if why) == 1002 - 400  # all but 200-599 refused
    assert not any("10.0.0.7" in text or "secret" in text for text in pure["safe"][1::2])


def _except_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, set[str]]:
    """Each name the function's own ``except ... as name`` clauses bind -> the exception types it is bound to."""
    bound: dict[str, set[str]] = {}
    todo: list[ast.AST] = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue  # a scope of its own: checked on its own
        if isinstance(node, ast.ExceptHandler) and node.name:
            bound.setdefault(node.name, set()).add(ast.unparse(node.type) if node.type else "BaseException")
        todo.extend(ast.iter_child_nodes(node))
    return bound


def test_no_compiled_function_binds_one_name_to_two_exception_types() -> None:
    """mypyc gives a name one type, its first ``except`` clause's: ``except A as exc`` then ``except B as exc``
    raises TypeError("A object expected; got B") in the compiled build on B's path, which the pure build never
    shows (found by issue 31 item 2: an agent's answer to a node's malformed status line, and the gateway's to a
    client that stopped reading, failed so compiled). Each clause of a compiled module binds a name of its own."""
    twice = [f"{path}:{fn.lineno} {fn.name}(): {name} as {' and '.join(sorted(types))}"
             for path in build.COMPILED
             for fn in ast.walk(ast.parse((ROOT / path).read_text()))
             if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
             for name, types in _except_names(fn).items() if len(types) > 1]
    assert not twice, twice
