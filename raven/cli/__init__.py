"""The `raven` command (``raven = "raven.cli:main"``): its commands in ``commands``, ``raven certs`` in ``certs``."""

from raven.cli.commands import main

__all__ = ["main"]
