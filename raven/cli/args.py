"""What the commands' arguments share: the argument types, `--version`, and the flags and start-up of a service
command (`raven gateway`, `raven agent`: gateway/command.py and agent/command.py plug them in)."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from raven import version
from raven.cli.runtime import fix_mmap_threshold, run_async, setup_logging
from raven.config import AgentConfig, GatewayConfig, build

EPILOG_CONFIG = (
    "Settings come from the YAML file, then RAVEN_* environment variables (nested fields joined with "
    "'__', e.g. RAVEN_TLS__CERT=/etc/raven/tls.crt), then --set FIELD.PATH=VALUE and the flags above. "
    "Commented examples: deploy/examples/."
)

# The flags both services take -> the configuration field each sets.
COMMON = {"cert": "tls.cert", "key": "tls.key", "ca": "tls.ca", "metrics_listen": "metrics_listen",
          "log_level": "log_level"}


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 and at most 3600 seconds")
    return value


def count(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{text[:20]!r}: must be a whole number from {low} to {high}")
        return int(text)
    return parse


def add_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=version.describe(),
                   help="print the release and the tunnel protocol versions it speaks, and exit")


def add_service_flags(p: argparse.ArgumentParser) -> None:
    add_version(p)  # `raven gateway --version` answers as `raven --version` does
    p.add_argument("--config", "-c", type=Path, help="YAML configuration file")
    p.add_argument("--set", action="append", default=[], metavar="FIELD.PATH=VALUE",
                   help="override one setting, e.g. --set limits.heartbeat_timeout=8 (repeatable)")
    p.add_argument("--cert", help="PEM certificate (tls.cert)")
    p.add_argument("--key", help="PEM private key (tls.key)")
    p.add_argument("--ca", help="PEM CA bundle for the peer (tls.ca)")
    p.add_argument("--metrics-listen", metavar="HOST:PORT", help="/metrics, /healthz, /readyz listener")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log verbosity")
    p.add_argument("--check", action="store_true", help="validate the configuration, print it, and exit")


def overrides(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """The ``--set`` overrides the flags given stand for (flag attribute -> field path), then ``--set`` itself."""
    out = [f"{field}={getattr(args, attr)}" for attr, field in flags.items() if getattr(args, attr, None) is not None]
    return [*out, *args.set]


C = TypeVar("C", GatewayConfig, AgentConfig)


def run_service(args: argparse.Namespace, model: type[C], flags: dict[str, str],
                start: Callable[[C, Callable[[], C], Path | None], Awaitable[int]], *,
                many_sessions: bool = False) -> int:
    """Build the configuration (file, environment, flags), print it for ``--check``, else run the service:
    ``start(config, load, path)``, where ``load`` builds it again the same way on SIGHUP or a changed file.
    ``many_sessions``: the process holds a TLS session per agent (the gateway; runtime.fix_mmap_threshold)."""
    sets = overrides(args, {**COMMON, **flags})
    cfg: C = build(model, args.config, sets)
    if args.check:
        print(cfg.model_dump_json(indent=2))
        return 0
    setup_logging(cfg.log_level)
    if many_sessions:
        fix_mmap_threshold()

    def load() -> C:
        new: C = build(model, args.config, sets)
        return new

    async def main() -> int:
        return await start(cfg, load, args.config)

    return run_async(main())
