"""The agent's command, plugged into `raven` (pyproject's ``raven.commands`` entry points; raven/cli/commands.py):
``raven agent`` runs the edge gateway agent."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from raven.cli import args as cli
from raven.config import AgentConfig


def add_agent(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ag = sub.add_parser(
        "agent", help="run the edge-side agent (dials out to the gateway)",
        description="Run an edge gateway agent: dial out to the cloud gateway over mutual TLS, register this "
        "pool's nodes, and forward streams to their exporter ports.", epilog=cli.EPILOG_CONFIG,
    )
    cli.add_service_flags(ag)
    ag.add_argument("--gateway-url", metavar="WSS_URL", help="gateway tunnel URL (gateway.url)")
    ag.add_argument("--pool", help="the edge pool this agent serves (one of its certificate's pools; default: the "
                    "certificate's pool when it names only one)")
    ag.add_argument("--name", help="agent identity (default: from the certificate)")
    ag.set_defaults(func=run_agent)


def run_agent(args: argparse.Namespace) -> int:
    flags = {"gateway_url": "gateway.url", "pool": "pool", "name": "name"}

    async def start(cfg: AgentConfig, load: Callable[[], AgentConfig], path: Path | None) -> int:
        from agent.service import Agent

        return await Agent(cfg, load, path).run()

    return cli.run_service(args, AgentConfig, flags, start)
