"""The product's imports run one way and close no circle (issue 30): drawn from the source, every import counted
(at the top, inside a function, under ``TYPE_CHECKING``), so that a deferred import cannot hide a circle.

The layers, lowest first:

- ``raven/protocol/``: the sans-I/O core; imports the standard library and itself, nothing else;
- the rest of ``raven/``: the library both services share, with the ``raven`` command (``raven/cli/``); never imports
  ``gateway`` or ``agent``;
- ``gateway/`` and ``agent/``: the services; neither imports the other. Each plugs its commands into ``raven``
  through pyproject.toml's ``raven.commands`` entry points (gateway/command.py, agent/command.py), so that the
  command line reaches the services without an import that runs up.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("raven", "gateway", "agent")

# The two leaves of raven/ the core may use: the error base and the log escaping, which import the standard
# library only (tests/unit/test_protocol_closed.py holds them to it). Nothing may be added to this.
PROTOCOL_LEAVES = {"raven.errors", "raven.logsafe"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """Every module of the product that ``name`` imports, wherever in the file the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:  # "raven.protocol.wire.Open" -> the module raven.protocol.wire
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(name, path, known)) for name, path in known.items()}


def third_party(path: Path) -> set[str]:
    tops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            tops.add(node.module.split(".")[0])
    # mypy_extensions only marks classes for the compiled build (raven/build.py): no run-time dependency of note.
    return {t for t in tops if t not in sys.stdlib_module_names and t not in ("raven", "mypy_extensions")}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer(name: str) -> str:
    if name == "raven.protocol" or name.startswith("raven.protocol."):
        return "protocol"
    return name.split(".")[0]  # raven, gateway, agent


ALLOWED = {"protocol": {"protocol"}, "raven": {"protocol", "raven"}, "gateway": {"protocol", "raven", "gateway"},
           "agent": {"protocol", "raven", "agent"}}


def test_no_import_runs_up_a_layer() -> None:
    upward = sorted((src, dst) for src, dsts in graph().items() for dst in dsts
                    if layer(dst) not in ALLOWED[layer(src)]
                    and not (layer(src) == "protocol" and dst in PROTOCOL_LEAVES))
    assert upward == [], "imports that run up a layer (or across, between the services): " + ", ".join(
        f"{src} -> {dst}" for src, dst in upward)


def test_the_protocol_core_imports_the_standard_library_only() -> None:
    outside = {name: sorted(third_party(path)) for name, path in modules().items()
               if layer(name) == "protocol" and third_party(path)}
    assert outside == {}


def test_no_import_circle() -> None:
    assert circles(graph()) == []


@pytest.mark.parametrize(("edges", "expected"), [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert circles(edges) == expected


def test_a_deferred_import_counts(tmp_path: Path) -> None:
    """An import inside a function (or under TYPE_CHECKING) is an edge like any other: the hosts/shards circle
    was hidden that way."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from raven.dns import shards\n\nif False:\n    import gateway.service\n")
    known = {"raven.dns.shards": module, "gateway.service": module, "raven.dns": module}
    assert set(imported("x", module, known)) == {"raven.dns.shards", "gateway.service"}


def test_the_services_commands_are_plugged_in_where_pyproject_says() -> None:
    """Each ``raven.commands`` entry point names a function of the service packages that exists, and the
    command line lists every one it expects from them (raven/cli/commands.py SERVICE_COMMANDS)."""
    import importlib
    import tomllib

    from raven.cli import commands

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][commands.PLUGINS]
    assert sorted(declared) == sorted(commands.SERVICE_COMMANDS)
    for name, target in declared.items():
        module, _, attr = target.partition(":")
        assert layer(module) in ("gateway", "agent"), f"{name}: {target} is not a service's command"
        assert callable(getattr(importlib.import_module(module), attr)), target


def test_a_missing_service_command_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Run from a tree whose distribution is not installed (no entry points), ``raven gateway`` still parses and
    says what is missing and how to install it, in one line: not argparse's "invalid choice"."""
    from raven.cli import commands

    monkeypatch.setattr(commands, "plugins", dict)
    assert commands.main(["gateway", "--config", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert "raven gateway: error: this copy of Raven has no 'gateway' command" in err
    assert "scripts/setup.sh" in err and "Traceback" not in err


def test_a_plug_in_that_does_not_load_fails_alone(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A ``raven.commands`` entry point whose module does not import (a broken install, a third party's plug-in)
    leaves every other command working, and its own command says why in one line."""
    from importlib import metadata

    from raven.cli import commands

    broken = metadata.EntryPoint("gateway", "gateway.no_such_module:add", commands.PLUGINS)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [broken])
    assert commands.main(["certs", "show", "/nonexistent.pem"]) != 0  # parsed and run: its own error, not ours
    capsys.readouterr()
    assert commands.main(["gateway"]) == 2
    err = capsys.readouterr().err
    assert "no 'gateway' command: its entry point gateway.no_such_module:add does not load" in err
    assert "ModuleNotFoundError" in err and "Traceback" not in err


def test_the_command_line_does_not_load_the_kubernetes_client_before_a_command_needs_it() -> None:
    """`raven agent` (and `raven gateway`) build every command's parser at start: `raven check`'s cluster reader
    (kubernetes_asyncio, ~900 modules, ~40 MiB of an agent's resident memory) is imported only when that command
    runs."""
    probe = ("import sys; from raven.cli import commands; commands.build_parser(); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes_asyncio')[:5])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]
