"""raven/protocol is a closed world: read from the source's own imports (every ``import``, at any depth, deferred
ones too), it needs nothing but the standard library, itself and the two modules at the bottom of the house
(raven/errors.py, raven/logsafe.py: standard library only). Nothing in it runs back up into the services' words
(raven/refusals.py, HTTP statuses, metric labels), and its modules import no circle among themselves."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "raven" / "protocol"
FOUNDATION = {"raven.errors", "raven.logsafe"}  # below the core: they import the standard library only
# mypy_extensions.mypyc_attr marks a class for the compiled build (raven/build.py); at run time it is a no-op.
COMPILE_MARKS = {"mypy_extensions"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (``from a import b`` counts as ``a`` and, when it is one, ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if (ROOT / Path(*sub.split("."))).with_suffix(".py").exists():
                    found.add(sub)
    return found


def is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names or name == "__future__"


def test_the_core_imports_only_itself_the_standard_library_and_the_foundation() -> None:
    strays = {}
    for path in sorted(PROTOCOL.rglob("*.py")):
        outside = {m for m in imports_of(path)
                   if not is_stdlib(m) and m not in FOUNDATION and m not in COMPILE_MARKS and m != "raven.protocol"
                   and not m.startswith("raven.protocol.")}
        if outside:
            strays[module_name(path)] = sorted(outside)
    assert strays == {}, f"raven/protocol imports from outside its world: {strays}"


def test_the_foundation_under_the_core_imports_only_the_standard_library() -> None:
    for name in sorted(FOUNDATION):
        path = ROOT / Path(*name.split(".")).with_suffix(".py")
        assert {m for m in imports_of(path) if not is_stdlib(m)} == set(), name


def test_the_cores_modules_import_no_circle() -> None:
    graph = {module_name(p): {m for m in imports_of(p) if m.startswith("raven.protocol.")}
             for p in PROTOCOL.rglob("*.py")}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path[path.index(name):], name))}"
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


def test_the_walk_sees_a_stray_import_when_there_is_one(tmp_path: Path) -> None:
    """The check itself: an import of raven/refusals.py (what raven/protocol/handshake.py had) is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("import enum\n\ndef f() -> None:\n    from raven.refusals import Reason  # deferred: found too\n")
    assert imports_of(probe) == {"enum", "raven.refusals"}
