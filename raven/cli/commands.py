"""The `raven` command: gateway, agent, certs, routes, hosts, dns, status, demo.

One argparse tree and one small function per command; the commands' work lives in their own modules. This is
the composition root: the one module of raven/ that starts the services (gateway/, agent/); nothing imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from raven import logsafe, version
from raven.cli import certs, install
from raven.cli import check as check_cmd
from raven.config import AgentConfig, GatewayConfig, build
from raven.errors import CommandFailed, ConfigError, RavenError, UsageError
from raven.http import parsererrors
from raven.layer3 import noderoutes

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
    logsafe.install()  # every line redacted, escaped and bounded, whoever wrote it and whatever a peer sent
    parsererrors.install()  # aiohttp's lines about malformed requests: one short line per client and minute
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


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 128 * 1024


def fix_mmap_threshold() -> None:
    """Keep large allocations in their own mappings (glibc), so an idle TLS session costs little.

    uvloop gives every TLS connection a 256 KiB read buffer of which an idle session touches a
    page or two. glibc's default *dynamic* mmap threshold soon moves such blocks onto the heap,
    where freed and reused pages stay resident; a fixed 128 KiB threshold keeps each in its own
    mapping (untouched pages cost no memory): about 4 KiB less per idle session with 1,000 agents.
    The data path allocates nothing that large: DATA frames are at most 64 KiB, and the guarded
    listeners take TLS bytes as a buffered protocol (uvloop would otherwise allocate 256 KiB per
    decrypted record, each then an mmap/munmap pair). A MALLOC_MMAP_THRESHOLD_ set by the operator
    wins; elsewhere than glibc this does nothing.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is not None and not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
            log.debug("mallopt(M_MMAP_THRESHOLD) was refused")
    except OSError as exc:
        log.debug("cannot set the mmap threshold: %s", exc)


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


def _add_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=version.describe(),
                   help="print the release and the tunnel protocol versions it speaks, and exit")


def _add_common(p: argparse.ArgumentParser) -> None:
    _add_version(p)  # `raven gateway --version` answers as `raven --version` does
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
    overrides = _overrides(args, {
        **COMMON, "listen": "front.listen", "tunnel_listen": "tunnel.listen", "replica_id": "replica_id",
    })
    cfg = build(GatewayConfig, args.config, overrides)
    if args.check:
        print(cfg.model_dump_json(indent=2))
        return 0
    setup_logging(cfg.log_level)
    fix_mmap_threshold()
    from gateway.service import Gateway

    def load() -> GatewayConfig:  # on SIGHUP or a changed file: built as at start (file, environment, flags)
        new: GatewayConfig = build(GatewayConfig, args.config, overrides)
        return new

    async def main() -> int:
        return await Gateway(cfg, load, args.config).run()

    return run_async(main())


def cmd_agent(args: argparse.Namespace) -> int:
    overrides = _overrides(args, {**COMMON, "gateway_url": "gateway.url", "pool": "pool", "name": "name"})
    cfg = build(AgentConfig, args.config, overrides)
    if args.check:
        print(cfg.model_dump_json(indent=2))
        return 0
    setup_logging(cfg.log_level)
    from agent.service import Agent

    def load() -> AgentConfig:  # on SIGHUP or a changed file: built as at start (file, environment, flags)
        new: AgentConfig = build(AgentConfig, args.config, overrides)
        return new

    async def main() -> int:
        return await Agent(cfg, load, args.config).run()

    return run_async(main())


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 and at most 3600 seconds")
    return value


STATUS_STATES = ["failing", "unreachable", "refused", "idle", "ok", "direct"]  # gateway/status.py's STATES


def _count(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{text[:20]!r}: must be a whole number from {low} to {high}")
        return int(text)
    return parse


async def _ops_json(gateway: str, path: str, token_file: Path | None, timeout: float = 10.0) -> Any:
    """GET a JSON document from a gateway's ops listener (bounded: raven/ops/client.py); every failure is a
    CommandFailed that says why."""
    from raven.ops import client

    return await client.get_json(gateway, path, client.read_token_file(token_file), timeout)


async def _gateway_nodes(url: str, token_file: Path | None = None) -> tuple[list[str], list[str]]:
    """Tunnel pools' node names and the service addresses from a running gateway's ops listener (/nodes)."""
    data = await _ops_json(url, "/nodes", token_file)
    try:
        # Only the nodes that go through Raven belong in its hosts file (a direct pool's are the cluster's).
        names = [str(n["name"]) for n in data["nodes"] if n.get("reach", "tunnel") == "tunnel"]
        addresses = [str(a) for a in data.get("service_addresses", [])]
    except (KeyError, TypeError, AttributeError) as exc:
        raise CommandFailed(f"cannot read the node list from {url}/nodes (is it a Raven gateway's ops listener?): "
                            f"{type(exc).__name__}: {exc}") from None
    return names, addresses


async def _names_and_addresses(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    names: list[str] = list(args.node)
    addresses: list[str] = list(args.address)
    if args.gateway:
        gw_names, gw_addresses = await _gateway_nodes(args.gateway, args.token_file)
        names += gw_names
        addresses = addresses or gw_addresses
    if not names and not args.gateway:
        raise UsageError("say which nodes: --gateway http://GATEWAY:10265 or --node NAME (repeatable)")
    if not addresses:
        raise UsageError("no service address: pass --address IP (or configure hosts.service_addresses)")
    return names, addresses


def cmd_hosts_render(args: argparse.Namespace) -> int:
    from raven.dns.hosts import render

    async def main() -> int:
        names, addresses = await _names_and_addresses(args)
        try:
            sys.stdout.write(render(names, addresses, writer="raven hosts render"))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return 0

    return asyncio.run(main())


def cmd_status(args: argparse.Namespace) -> int:
    import json
    from urllib.parse import urlencode

    from gateway.statuspage import render_text

    params = [("pool", p) for p in args.pool] + [("state", s) for s in args.state]
    params += [("q", args.node)] if args.node else []
    params += [("limit", str(args.limit))] if args.limit is not None else []
    params += [("offset", str(args.offset))] if args.offset else []

    async def main() -> int:
        path = "/status" + (f"?{urlencode(params)}" if params else "")
        snap = await _ops_json(args.gateway, path, args.token_file, args.timeout)
        if args.output == "json":
            print(json.dumps(snap, indent=2))
        else:
            try:
                sys.stdout.write(render_text(snap))
            except (KeyError, TypeError) as exc:
                raise CommandFailed(f"{args.gateway}/status is not a Raven gateway's status: {exc!r}") from None
        return 0

    return asyncio.run(main())


def cmd_dns_check(args: argparse.Namespace) -> int:
    from raven.dns.check import check_all
    from raven.errors import CheckError

    async def main() -> int:
        names, addresses = await _names_and_addresses(args)
        if not names:
            print("raven dns check: the gateway knows no edge nodes yet; nothing to check", file=sys.stderr)
            return 1
        try:
            results = await check_all(names, addresses, args.server, timeout=args.timeout)
        except CheckError as exc:
            raise UsageError(str(exc)) from None
        width = max(len(r.name) for r in results)
        print(f"{'NODE':<{width}}  {'RESULT':<6}  ANSWER (expected {', '.join(addresses)})")
        for r in results:
            answer = r.error or (", ".join(r.got) if r.got else "no address")
            print(f"{r.name:<{width}}  {'ok' if r.ok else 'WRONG':<6}  {answer}")
        bad = [r for r in results if not r.ok]
        print(f"{len(results) - len(bad)} of {len(results)} names resolve to the Raven service via {args.server}")
        if bad and all(r.no_answer for r in bad):
            print(f"Fix: the DNS server {args.server} did not answer: check its address and port, and that it can "
                  "be reached from here (a firewall, a NetworkPolicy).")
        elif bad:
            print("Fix: check that CoreDNS's hosts plugin reads the file Raven publishes "
                  "(deploy/coredns/README.md) and that the names above are in it: raven hosts render.")
        return 1 if bad else 0

    return asyncio.run(main())


def cmd_demo(args: argparse.Namespace) -> int:
    from raven.demo import demo

    setup_logging("warning" if not args.verbose else "info")
    return run_async(demo.main(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raven",
        description="Raven: cloud Prometheus scrapes edge nodes behind NAT by Kubernetes node name, "
        "through mutually authenticated tunnels that edge agents dial out to the cloud gateway.",
    )
    _add_version(parser)
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
    ag.add_argument("--pool", help="the edge pool this agent serves (one of its certificate's pools; default: the "
                    "certificate's pool when it names only one)")
    ag.add_argument("--name", help="agent identity (default: from the certificate)")
    ag.set_defaults(func=cmd_agent)

    certs.add_parser(sub)
    install.add_parser(sub)
    check_cmd.add_parser(sub)
    noderoutes.add_parser(sub)

    def names_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--gateway", metavar="URL", help="a gateway's ops listener (e.g. http://raven-gateway:10265): "
                       "take the edge node names and the service addresses from it")
        p.add_argument("--token-file", type=Path, metavar="FILE",
                       help="file with a bearer token the gateway accepts (front.auth.token_files), for --gateway")
        p.add_argument("--node", action="append", default=[], metavar="NAME", help="an edge node name (repeatable)")
        p.add_argument("--address", action="append", default=[], metavar="IP",
                       help="the Raven service address names must resolve to (repeatable; IPv4 and/or IPv6)")

    hosts = sub.add_parser("hosts", help="the hosts file for CoreDNS's hosts plugin",
                           description="Work with the hosts file that maps edge node names to the Raven service.")
    hosts_sub = hosts.add_subparsers(dest="hosts_command", metavar="SUBCOMMAND", required=True)
    render = hosts_sub.add_parser(
        "render", help="print the hosts file once",
        description="Print the whole hosts file (sorted, exact names, one line per node and address) for the "
        "nodes a gateway knows or the nodes given, pointing at the service address(es).",
    )
    names_args(render)
    render.set_defaults(func=cmd_hosts_render)

    dns_parser = sub.add_parser("dns", help="check name resolution of edge nodes",
                                description="Check that edge node names resolve to the Raven service.")
    dns_sub = dns_parser.add_subparsers(dest="dns_command", metavar="SUBCOMMAND", required=True)
    check = dns_sub.add_parser(
        "check", help="ask a DNS server for every edge node name",
        description="Ask a DNS server (e.g. the cluster's CoreDNS) for every edge node name and report, per node, "
        "whether it resolves to the Raven service address. Exits 1 when any does not: the first thing to run "
        "when a scrape says 'no such host'.",
    )
    check.add_argument("--server", required=True, metavar="ADDR[:PORT]", help="DNS server to ask (port 53 default)")
    check.add_argument("--timeout", type=_positive_seconds, default=3.0, help="seconds per query (default 3)")
    names_args(check)
    check.set_defaults(func=cmd_dns_check)

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
    status.add_argument("--state", action="append", default=[], choices=STATUS_STATES,
                        help="only the nodes in this state (repeatable); without it, every state, those that need "
                        "attention (failing, unreachable, refused) first")
    status.add_argument("--limit", type=_count(1, 1000), metavar="N", help="nodes to list (default 50, at most 1000)")
    status.add_argument("--offset", type=_count(0, 10**8), default=0, metavar="N",
                        help="skip the first N nodes of the list (the next page)")
    status.add_argument("--timeout", type=_positive_seconds, default=10.0,
                        help="seconds to wait for the gateway (default 10)")
    status.set_defaults(func=cmd_status)

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
    except KeyboardInterrupt:
        return 130
    except RavenError as exc:  # one line a user can act on, never a traceback
        prefix = "" if isinstance(exc, ConfigError) else "error: "
        print(f"raven {args.command}: {prefix}{exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # e.g. an address already in use, a file that cannot be read
        print(f"raven {args.command}: error: {exc}", file=sys.stderr)
        return 1
