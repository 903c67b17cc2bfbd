"""The `raven` command: gateway, agent, certs, install, check, routes, hosts, dns, status, demo.

One argparse tree and one small function per command; the commands' work lives in their own modules. The services'
commands (`raven gateway`, `raven agent`, `raven status`) are not imported from here: gateway/command.py and
agent/command.py plug them in through the ``raven.commands`` entry points that pyproject.toml declares, so that
nothing in raven/ imports up into the services (tests/unit/test_import_layers.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from raven.cli import args as cli
from raven.cli import certs, install
from raven.cli import check as check_cmd
from raven.cli.runtime import run_async, setup_logging
from raven.errors import CommandFailed, ConfigError, RavenError, UsageError
from raven.layer3 import noderoutes

PLUGINS = "raven.commands"  # entry-point group: name = the command, value = add(subparsers)
# The help lists the commands in this order; a plugin not named here comes last.
ORDER = ("gateway", "agent", "certs", "install", "check", "routes", "hosts", "dns", "status", "demo")
SERVICE_COMMANDS = ("gateway", "agent", "status")  # what this distribution plugs in itself (pyproject.toml)

Adder = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], object]


def plugins() -> dict[str, Adder]:
    """The commands other packages plug in, by name (this distribution's own: SERVICE_COMMANDS). One that does not
    load is a command that says why when it is run; the other commands work (never a traceback for all)."""
    found: dict[str, Adder] = {}
    for ep in metadata.entry_points(group=PLUGINS):
        try:
            found[ep.name] = ep.load()
        except Exception as exc:  # any import error of a plug-in: reported by its command alone
            found[ep.name] = _not_installed(ep.name, f"its entry point {ep.value} does not load: "
                                                     f"{type(exc).__name__}: {exc}")
    return found


def _not_installed(name: str, why: str = "") -> Adder:
    why = why or (f"its entry point ({PLUGINS}) is not installed; install the distribution (pip install ., or "
                  "bash scripts/setup.sh)")

    def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        p = sub.add_parser(name, help=f"(not available: {why})"[:120], add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs=argparse.REMAINDER)

        def refuse(args: argparse.Namespace) -> int:
            raise UsageError(f"this copy of Raven has no {name!r} command: {why}")

        p.set_defaults(func=refuse)
    return add


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


def _names_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", metavar="URL", help="a gateway's ops listener (e.g. http://raven-gateway:10265): "
                   "take the edge node names and the service addresses from it")
    p.add_argument("--token-file", type=Path, metavar="FILE",
                   help="file with a bearer token the gateway accepts (front.auth.token_files), for --gateway")
    p.add_argument("--node", action="append", default=[], metavar="NAME", help="an edge node name (repeatable)")
    p.add_argument("--address", action="append", default=[], metavar="IP",
                   help="the Raven service address names must resolve to (repeatable; IPv4 and/or IPv6)")


def _add_hosts(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    hosts = sub.add_parser("hosts", help="the hosts file for CoreDNS's hosts plugin",
                           description="Work with the hosts file that maps edge node names to the Raven service.")
    hosts_sub = hosts.add_subparsers(dest="hosts_command", metavar="SUBCOMMAND", required=True)
    render = hosts_sub.add_parser(
        "render", help="print the hosts file once",
        description="Print the whole hosts file (sorted, exact names, one line per node and address) for the "
        "nodes a gateway knows or the nodes given, pointing at the service address(es).",
    )
    _names_args(render)
    render.set_defaults(func=cmd_hosts_render)


def _add_dns(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    check.add_argument("--timeout", type=cli.positive_seconds, default=3.0, help="seconds per query (default 3)")
    _names_args(check)
    check.set_defaults(func=cmd_dns_check)


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


BUILT_IN: dict[str, Adder] = {
    "certs": certs.add_parser, "install": install.add_parser, "check": check_cmd.add_parser,
    "routes": noderoutes.add_parser, "hosts": _add_hosts, "dns": _add_dns, "demo": _add_demo,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raven",
        description="Raven: cloud Prometheus scrapes edge nodes behind NAT by Kubernetes node name, "
        "through mutually authenticated tunnels that edge agents dial out to the cloud gateway.",
    )
    cli.add_version(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    found = plugins()
    adders = {name: _not_installed(name) for name in SERVICE_COMMANDS} | found | BUILT_IN
    for name in sorted(adders, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        adders[name](sub)
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
