"""``raven certs``: create a development CA, issue gateway and agent certificates, inspect certificates."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from raven import pki

DEFAULT_DIR = Path("certs/dev")

_Handler = Callable[[argparse.Namespace], int]

_CERTS_DESCRIPTION = """\
Manage the certificates Raven uses for TLS 1.3 mutual authentication between agents and the gateway.

A typical development setup:

  raven certs init                                  # CA in certs/dev/ca.pem, certs/dev/ca-key.pem
  raven certs issue gateway gateway.example.com     # gateway (TLS server) certificate
  raven certs issue agent edge-a --pool pool-a      # agent (TLS client) certificate for pool-a
  raven certs show certs/dev/edge-a.pem             # what a certificate allows

An agent certificate lists the pools the agent may serve (URI SANs urn:raven:pool:<pool>); the gateway
refuses registrations of nodes outside them. Private keys are written with mode 0600; never commit them.
"""


def _days(value: str) -> int:
    try:
        days = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of days: {value!r}") from None
    if days < 1:
        raise argparse.ArgumentTypeError(f"number of days must be at least 1, got {days}")
    return days


def _fail(message: str) -> int:
    print(f"raven certs: error: {message}", file=sys.stderr)
    return 1


def _guarded(handler: _Handler) -> _Handler:
    """Turn PKIError and OSError into one error line on stderr and exit code 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except pki.PKIError as exc:
            return _fail(str(exc))
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            return _fail(f"{where}{exc.strerror or exc}")

    run.__name__ = handler.__name__
    run.__doc__ = handler.__doc__
    return run


def _cmd_init(args: argparse.Namespace) -> int:
    cert_path, key_path = pki.create_ca(args.dir, common_name=args.cn, days=args.days, overwrite=args.force)
    identity = pki.load_identity(cert_path)
    print(f"wrote CA certificate {cert_path}")
    print(f"wrote CA private key {key_path} (mode 0600; keep it secret, never commit it)")
    print()
    print(identity.describe())
    print()
    print("Next: raven certs issue gateway NAME --dns NAME, raven certs issue agent NAME --pool POOL")
    return 0


def _print_issued(cert_path: Path, key_path: Path) -> None:
    print(f"wrote certificate {cert_path}")
    print(f"wrote private key {key_path} (mode 0600)")
    print()
    print(pki.load_identity(cert_path).describe())


def _cmd_issue_gateway(args: argparse.Namespace) -> int:
    cert_path, key_path = pki.issue(
        args.dir,
        args.dir,
        "gateway",
        args.name,
        dns_names=args.dns or (),
        ip_addresses=args.ip or (),
        days=args.days,
    )
    _print_issued(cert_path, key_path)
    return 0


def _cmd_issue_agent(args: argparse.Namespace) -> int:
    cert_path, key_path = pki.issue(args.dir, args.dir, "agent", args.name, pools=args.pool,
                                     cidrs=args.cidr or (), days=args.days)
    _print_issued(cert_path, key_path)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    print(pki.load_identity(args.file).describe())
    return 0


def _help_of(parser: argparse.ArgumentParser) -> _Handler:
    def show_help(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show_help


def _add_dir(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        metavar="DIR",
        help=f"{help_text} (default: {DEFAULT_DIR})",
    )


def _add_days(parser: argparse.ArgumentParser, default: int) -> None:
    parser.add_argument(
        "--days",
        type=_days,
        default=default,
        metavar="N",
        help=f"validity in days (default: {default})",
    )


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``certs`` command group to a ``raven`` command line."""
    fmt = argparse.HelpFormatter
    certs = subparsers.add_parser(
        "certs",
        help="create a CA, issue gateway and agent certificates, inspect certificates",
        description=_CERTS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    certs.set_defaults(func=_help_of(certs))
    commands = certs.add_subparsers(title="commands", dest="certs_command", metavar="COMMAND")

    init = commands.add_parser(
        "init",
        help="create a new certificate authority",
        description=(
            "Create a certificate authority: writes ca.pem (give it to every gateway and agent as the trust "
            "anchor) and ca-key.pem (mode 0600; needed only to issue certificates) into DIR. The CA uses an "
            "ECDSA P-256 key. An existing CA is never replaced unless --force is given."
        ),
        formatter_class=fmt,
    )
    _add_dir(init, "directory for ca.pem and ca-key.pem; created with mode 0700 if missing")
    init.add_argument(
        "--cn",
        default="Raven development CA",
        metavar="NAME",
        help="common name of the CA (default: %(default)s)",
    )
    _add_days(init, 3650)
    init.add_argument(
        "--force",
        action="store_true",
        help="replace an existing CA; certificates it issued will no longer be trusted",
    )
    init.set_defaults(func=_guarded(_cmd_init))

    issue = commands.add_parser(
        "issue",
        help="issue a gateway or agent certificate signed by the CA",
        description=(
            "Issue a certificate signed by the CA in DIR. Writes NAME.pem (the certificate) and NAME-key.pem "
            "(its private key, mode 0600) into the same directory, replacing earlier files for NAME."
        ),
        formatter_class=fmt,
    )
    issue.set_defaults(func=_help_of(issue))
    kinds = issue.add_subparsers(title="certificate kinds", dest="certs_kind", metavar="KIND")

    gateway = kinds.add_parser(
        "gateway",
        help="TLS server certificate for the gateway",
        description=(
            "Issue a TLS server certificate (serverAuth) for the gateway. Agents check the gateway's name "
            "against the DNS names and IP addresses in it, so list every name agents connect to. Without "
            "--dns, NAME itself is used as the DNS name."
        ),
        epilog="example: raven certs issue gateway gateway --dns gateway.example.com --ip 10.0.0.1",
        formatter_class=fmt,
    )
    gateway.add_argument(
        "name", metavar="NAME", help="certificate name: common name and file name (NAME.pem)"
    )
    gateway.add_argument(
        "--dns",
        action="append",
        metavar="NAME",
        help="DNS name the certificate is valid for; repeat for several (default: NAME)",
    )
    gateway.add_argument(
        "--ip",
        action="append",
        metavar="ADDR",
        help="IP address the certificate is valid for; repeat for several",
    )
    _add_dir(gateway, "directory holding the CA; the certificate is written there too")
    _add_days(gateway, 365)
    gateway.set_defaults(func=_guarded(_cmd_issue_gateway))

    agent = kinds.add_parser(
        "agent",
        help="TLS client certificate for an edge agent",
        description=(
            "Issue a TLS client certificate (clientAuth) for an edge agent. The certificate names the agent "
            "(urn:raven:agent:NAME) and lists every pool it may serve (urn:raven:pool:POOL); the gateway "
            "refuses registrations of nodes outside these pools. Names are RFC 1123 labels: lowercase "
            "letters, digits and '-', at most 63 characters."
        ),
        epilog="example: raven certs issue agent edge-a --pool pool-a --pool pool-b",
        formatter_class=fmt,
    )
    agent.add_argument("name", metavar="NAME", help="agent name: common name and file name (NAME.pem)")
    agent.add_argument(
        "--pool",
        action="append",
        required=True,
        metavar="POOL",
        help="pool the agent may serve; required, repeat for several",
    )
    agent.add_argument(
        "--cidr",
        action="append",
        metavar="CIDR",
        help="layer 3: an IP range the agent may announce for its pools (urn:raven:cidr:), repeat for several; "
        "the gateway routes only ranges both this list and its configuration allow",
    )
    _add_dir(agent, "directory holding the CA; the certificate is written there too")
    _add_days(agent, 365)
    agent.set_defaults(func=_guarded(_cmd_issue_agent))

    show = commands.add_parser(
        "show",
        help="show what a certificate allows",
        description=(
            "Print what a certificate allows: its role (gateway, agent or CA), the agent name and pools it "
            "may serve, the DNS names and IP addresses it is valid for, and whether it is valid now. Reads "
            "the first certificate of a PEM file."
        ),
        formatter_class=fmt,
    )
    show.add_argument("file", type=Path, metavar="FILE", help="certificate file, e.g. certs/dev/edge-a.pem")
    show.set_defaults(func=_guarded(_cmd_show))
