"""The gateway's commands, plugged into `raven` (pyproject's ``raven.commands`` entry points; raven/cli/commands.py):
``raven gateway`` runs the service; ``raven status`` reads what one of its replicas sees."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode

from raven.cli import args as cli
from raven.config import GatewayConfig
from raven.errors import CommandFailed


def add_gateway(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gw = sub.add_parser(
        "gateway", help="run the cloud-side gateway (tunnel endpoint and proxy front end)",
        description="Run the cloud gateway: accept agent tunnels on wss://HOST:10262/tunnel (mutual TLS), and "
        "proxy Prometheus's requests for edge nodes (by Host header, absolute URI or CONNECT) to a "
        "healthy agent of the node's pool.", epilog=cli.EPILOG_CONFIG,
    )
    cli.add_service_flags(gw)
    gw.add_argument("--listen", metavar="HOST:PORT", help="front end for Prometheus (front.listen, default :10263)")
    gw.add_argument("--tunnel-listen", metavar="HOST:PORT", help="tunnel listener (tunnel.listen, default :10262)")
    gw.add_argument("--replica-id", help="this replica's id (default: host name)")
    gw.set_defaults(func=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    flags = {"listen": "front.listen", "tunnel_listen": "tunnel.listen", "replica_id": "replica_id"}

    async def start(cfg: GatewayConfig, load: Callable[[], GatewayConfig], path: Path | None) -> int:
        from gateway.service import Gateway

        return await Gateway(cfg, load, path).run()

    return cli.run_service(args, GatewayConfig, flags, start, many_sessions=True)


def add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gateway.status import STATES

    status = sub.add_parser(
        "status", help="pools, agents, sessions and the nodes that need attention, from a gateway",
        description="Show what one gateway replica sees: its release, its pools with their agents (release, protocol, "
        "session age, streams in flight, draining), nodes reachable, scrapes failing now and the latest error; "
        "then the nodes, those that need attention first (failing, unreachable, refused), each with the result "
        "of its last scrape through this replica and why it failed: one page of them (--limit, --offset), "
        "narrowed with --pool, --node and --state. The same is on the ops port as a web page: "
        "http://GATEWAY:10265/status.html (?pool=, ?q=, ?state=).",
    )
    status.add_argument("--gateway", required=True, metavar="URL",
                        help="a gateway's ops listener, e.g. http://raven-gateway:10265 (one replica)")
    status.add_argument("--token-file", type=Path, metavar="FILE",
                        help="file with a bearer token the gateway accepts (front.auth.token_files)")
    status.add_argument("--output", "-o", choices=["table", "json"], default="table", help="default: table")
    status.add_argument("--pool", action="append", default=[], metavar="POOL",
                        help="only the nodes of this pool (repeatable)")
    status.add_argument("--node", metavar="TEXT", help="only the nodes whose name has TEXT in it")
    status.add_argument("--state", action="append", default=[], choices=STATES,
                        help="only the nodes in this state (repeatable); without it, every state, those that need "
                        "attention (failing, unreachable, refused) first")
    status.add_argument("--limit", type=cli.count(1, 1000), metavar="N",
                        help="nodes to list (default 50, at most 1000)")
    status.add_argument("--offset", type=cli.count(0, 10**8), default=0, metavar="N",
                        help="skip the first N nodes of the list (the next page)")
    status.add_argument("--timeout", type=cli.positive_seconds, default=10.0,
                        help="seconds to wait for the gateway (default 10)")
    status.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    import asyncio

    from gateway.statuspage import render_text
    from raven.ops import client

    params = [("pool", p) for p in args.pool] + [("state", s) for s in args.state]
    params += [("q", args.node)] if args.node else []
    params += [("limit", str(args.limit))] if args.limit is not None else []
    params += [("offset", str(args.offset))] if args.offset else []

    async def main() -> int:
        path = "/status" + (f"?{urlencode(params)}" if params else "")
        snap = await client.get_json(args.gateway, path, client.read_token_file(args.token_file), args.timeout)
        if args.output == "json":
            print(json.dumps(snap, indent=2))
        else:
            try:
                sys.stdout.write(render_text(snap))
            except (KeyError, TypeError) as exc:
                raise CommandFailed(f"{args.gateway}/status is not a Raven gateway's status: {exc!r}") from None
        return 0

    return asyncio.run(main())
