"""Raven: an edge tunnel gateway for scraping edge nodes by name."""

# The one place the release is written: pyproject.toml reads it (tool.setuptools.dynamic), and both services
# announce it (HELLO/WELCOME, raven_build_info, /status). What a release serves: docs/skew.md.
__version__ = "0.2.0"

from raven.build import prefer_sources

prefer_sources()  # RAVEN_BUILD=pure: the interpreted modules even where compiled ones are installed (build.py)
