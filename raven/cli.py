"""The `raven` command: gateway, agent, certs, demo."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from raven import __version__, cli_certs
from raven.config import AgentConfig, ConfigError, GatewayConfig, build

log = logging.getLogger("raven")

EPILOG_CONFIG = (
    "Settings come from the YAML file, then RAVEN_* environment variables (nested fields joined with "
    "'__', e.g. RAVEN_TLS__CERT=/etc/raven/tls.crt), then --set FIELD.PATH=VALUE and the flags above. "
    "Commented examples: deploy/examples/."
)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def raise_fd_limit() -> None:
    """A gateway holds one socket per agent session: lift the soft open-files limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError) as exc:
        log.warning("could not raise the open-files limit: %s", exc)


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed, else on the stock event loop."""
    raise_fd_limit()
    try:
        if os.environ.get("RAVEN_NO_UVLOOP"):
            raise ImportError("disabled by RAVEN_NO_UVLOOP")
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return int(uvloop.run(coro))


def _overrides(args: argparse.Namespace, mapping: dict[str, str]) -> list[str]:
    out = []
    for attr, field in mapping.items():
        value = getattr(args, attr, None)
        if value is not None:
            out.append(f"{field}={value}")
    return [*out, *args.set]


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path, help="YAML configuration file")
    p.add_argument("--set", action="append", default=[], metavar="FIELD.PATH=VALUE",
                   help="override one setting, e.g. --set limits.heartbeat_timeout=8 (repeatable)")
    p.add_argument("--cert", help="PEM certificate (tls.cert)")
    p.add_argument("--key", help="PEM private key (tls.key)")
    p.add_argument("--ca", help="PEM CA bundle for the peer (tls.ca)")
    p.add_argument("--metrics-listen", metavar="HOST:PORT", help="/metrics, /healthz, /readyz listener")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log verbosity")
    p.add_argument("--check", action="store_true", help="validate the configuration, print it, and exit")


COMMON = {"cert": "tls.cert", "key": "tls.key", "ca": "tls.ca", "metrics_listen": "metrics_listen",
          "log_level": "log_level"}


def cmd_gateway(args: argparse.Namespace) -> int:
    cfg = build(GatewayConfig, args.config, _overrides(args, {
        **COMMON, "listen": "front.listen", "tunnel_listen": "tunnel.listen", "replica_id": "replica_id",
    }))
    if args.check:
        print(cfg.model_dump_json(indent=2))
        return 0
    setup_logging(cfg.log_level)
    from gateway.service import Gateway

    async def main() -> int:
        return await Gateway(cfg).run()

    return run_async(main())


def cmd_agent(args: argparse.Namespace) -> int:
    cfg = build(AgentConfig, args.config, _overrides(args, {
        **COMMON, "gateway_url": "gateway.url", "pool": "pool", "name": "name",
    }))
    if args.check:
        print(cfg.model_dump_json(indent=2))
        return 0
    setup_logging(cfg.log_level)
    from agent.service import Agent

    async def main() -> int:
        return await Agent(cfg).run()

    return run_async(main())


def cmd_demo(args: argparse.Namespace) -> int:
    from raven import demo

    setup_logging("warning" if not args.verbose else "info")
    return run_async(demo.main(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raven",
        description="Raven: cloud Prometheus scrapes edge nodes behind NAT by Kubernetes node name, "
        "through mutually authenticated tunnels that edge agents dial out to the cloud gateway.",
    )
    parser.add_argument("--version", action="version", version=f"raven {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gw = sub.add_parser(
        "gateway", help="run the cloud-side gateway (tunnel endpoint and proxy front end)",
        description="Run the cloud gateway: accept agent tunnels on wss://HOST:10262/tunnel (mutual TLS), and "
        "proxy Prometheus's requests for edge nodes (by Host header, absolute URI or CONNECT) to a "
        "healthy agent of the node's pool.", epilog=EPILOG_CONFIG,
    )
    _add_common(gw)
    gw.add_argument("--listen", metavar="HOST:PORT", help="front end for Prometheus (front.listen, default :10263)")
    gw.add_argument("--tunnel-listen", metavar="HOST:PORT", help="tunnel listener (tunnel.listen, default :10262)")
    gw.add_argument("--replica-id", help="this replica's id (default: host name)")
    gw.set_defaults(func=cmd_gateway)

    ag = sub.add_parser(
        "agent", help="run the edge-side agent (dials out to the gateway)",
        description="Run an edge gateway agent: dial out to the cloud gateway over mutual TLS, register this "
        "pool's nodes, and forward streams to their exporter ports.", epilog=EPILOG_CONFIG,
    )
    _add_common(ag)
    ag.add_argument("--gateway-url", metavar="WSS_URL", help="gateway tunnel URL (gateway.url)")
    ag.add_argument("--pool", help="the edge pool this agent serves (must be in its certificate)")
    ag.add_argument("--name", help="agent identity (default: from the certificate)")
    ag.set_defaults(func=cmd_agent)

    cli_certs.add_parser(sub)

    demo = sub.add_parser(
        "demo", help="run a complete gateway + agents + simulated GPU nodes on this machine",
        description="Start, on loopback, an ephemeral PKI, a gateway, two edge pools with two agents each and "
        "simulated GPU nodes (DCGM metrics); scrape every node by name through the tunnel, then stop one "
        "agent and show the scrape still succeeding through the other agent of its pool. Exits 0 when all "
        "of that worked.",
    )
    demo.add_argument("--keep-running", action="store_true", help="stay up afterwards and print curl commands")
    demo.add_argument("--nodes-per-pool", type=int, default=3, help="simulated GPU nodes per pool (default 3)")
    demo.add_argument("--verbose", "-v", action="store_true", help="show the services' logs")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"raven {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear line, not a traceback, for start-up failures
        from raven.pki import PKIError
        from raven.tls import TLSError

        if isinstance(exc, PKIError | TLSError | OSError):
            print(f"raven {args.command}: error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
