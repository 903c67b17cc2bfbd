"""Builds Raven with its per-scrape path compiled by mypyc (raven/build.py lists the modules).

RAVEN_COMPILE=0 builds the pure-Python package instead. Everything else is in pyproject.toml.
"""

import ast
import os
from pathlib import Path

from setuptools import setup


def compiled_modules() -> list[str]:
    """raven/build.py's COMPILED, read without importing Raven (its dependencies need not be installed)."""
    tree = ast.parse(Path(__file__).with_name("raven").joinpath("build.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "COMPILED":
            assert node.value is not None
            return list(ast.literal_eval(node.value))
    raise RuntimeError("raven/build.py has no COMPILED list")


if os.environ.get("RAVEN_COMPILE", "1") == "0":
    setup()
else:
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        raise SystemExit("raven: the compiled build needs mypy>=1.10 and Raven's dependencies in the build "
                         "environment (pip install --no-build-isolation, as scripts/setup.sh does); "
                         "RAVEN_COMPILE=0 builds the pure one") from exc

    setup(ext_modules=mypycify(compiled_modules(), opt_level="3", debug_level="0"))
