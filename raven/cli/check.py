"""``raven check``: walk the cluster and the gateways' ops API and say, check by check, what is wrong and how to fix
it. The reading is raven/check/reader.py, the judging raven/check/checks.py (and pre.py for ``--pre``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from raven.errors import UsageError

if TYPE_CHECKING:
    from raven.check import reader

DESCRIPTION = """\
Check a Raven installation: the gateway Pods, the front Service's address against the hosts file, CoreDNS's
Corefile and mount, a sample of edge names resolving to the Service, every Node's pool, every pool's agents and
their sessions to every gateway replica, the certificates (more than 14 days left), the gateway/agent release
skew, the clocks (this machine, the API server, the gateway replicas and the agents within 5 s), Prometheus
scraping the edge job with up 1 for a sample of nodes, and each replica's open-files limit against the fleet's
need. One line per check, ✔ or ✘; under each ✘, what to run. Exit status 0 when all passed, 1 otherwise.

With --pre, check a cluster before installing instead: the API server's version, CoreDNS, cert-manager (with
--certificates cert-manager) and that --service-address is free."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check", help="check an installation (or, with --pre, a cluster before installing)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubeconfig", type=Path, metavar="FILE",
                   help="default: $KUBECONFIG, else ~/.kube/config, else the pod's service account")
    p.add_argument("--gateway", action="append", default=[], metavar="URL",
                   help="a gateway replica's ops listener (repeatable); default: every gateway Pod's address, port "
                   "10265 (reachable from inside the cluster)")
    p.add_argument("--token-file", type=Path, metavar="FILE",
                   help="the front end's bearer token for /status; default: Secret raven-gateway-front-token")
    p.add_argument("--dns-server", metavar="ADDR[:PORT]",
                   help="the DNS server to resolve sample edge names with; default: the kube-dns Service's address")
    p.add_argument("--prometheus", metavar="URL",
                   help="Prometheus's HTTP API; default: the Operator's Service prometheus-operated (port 9090, "
                   "reachable from inside the cluster)")
    p.add_argument("--prometheus-replicas", type=int, default=2, metavar="N",
                   help="Prometheus replicas scraping the fleet, each holding a connection per target (default 2: "
                   "an HA pair); sizes the descriptor check")
    p.add_argument("--output", "-o", choices=["text", "json"], default="text")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    p.add_argument("--pre", action="store_true", help="check the cluster before installing")
    p.add_argument("--service-address", metavar="IP", help="--pre: the address raven install will give the Service")
    p.add_argument("--certificates", choices=["cert-manager", "raven"], default="cert-manager",
                   help="--pre: whether cert-manager must be present (default cert-manager)")
    p.set_defaults(func=cmd_check)


def _kubeconfig(explicit: Path | None) -> Path | None:
    if explicit is not None:
        return explicit
    env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if env:
        return Path(env)
    home = Path.home() / ".kube" / "config"
    return home if home.is_file() else None


def _token(args: argparse.Namespace, view: reader.ClusterView) -> str | None:
    from raven.check import reader
    if args.token_file is not None:
        try:
            lines = [ln.strip() for ln in args.token_file.read_text().splitlines() if ln.strip()]
        except OSError as exc:
            raise UsageError(f"cannot read --token-file {str(args.token_file)!r}: {exc.strerror or exc}") from None
        if not lines:
            raise UsageError(f"--token-file {str(args.token_file)!r} holds no token")
        return str(lines[0])
    raw = reader.secret_value(view.secrets.get(reader.TOKEN_SECRET), "token")
    if raw is None:
        return None
    first = raw.decode("utf-8", "replace").strip().splitlines()
    return first[0].strip() if first else None


def cmd_check(args: argparse.Namespace) -> int:
    # Imported here, not at the top: the checks read the cluster with kubernetes_asyncio (~900 modules, ~25 MiB),
    # and every command's parser is built at start-up, `raven agent`'s too.
    from raven.check import checks, clock, descriptors, dnsprobe, pre, prom, reader, results

    if not 1 <= args.prometheus_replicas <= 100:
        raise UsageError("--prometheus-replicas must be from 1 to 100")
    if not 0 < args.timeout <= 600:
        raise UsageError("--timeout must be more than 0 and at most 600 seconds")
    kubeconfig = _kubeconfig(args.kubeconfig)

    async def main() -> list[results.Result]:
        if args.pre:
            return await pre.run(kubeconfig, args.service_address, args.certificates, args.timeout)
        view = await reader.read_cluster(kubeconfig, args.timeout)
        replicas = await reader.read_replicas(reader.ops_urls(view, args.gateway), _token(args, view), args.timeout)
        statuses = {url: r.status if r.status is not None else r.error for url, r in replicas.items()}
        found = checks.run_all(view, statuses, dt.datetime.now(dt.UTC))
        at = next(i for i, r in enumerate(found) if r.check == "coredns-corefile") + 1
        found.insert(at, await dnsprobe.dns_sample(view, args.dns_server, args.timeout))
        found.append(clock.clock_skew(view, replicas))
        url = args.prometheus or prom.service_url(view.prometheus_services)
        scraped = None
        if url is not None:
            scraped = await prom.read_prometheus(url, prom.sample_nodes(replicas, dnsprobe.sample_names(view, 50)),
                                                 args.timeout)
        found.append(prom.prometheus(scraped))
        nodes = max((descriptors.tunnel_nodes(r.status) for r in replicas.values() if r.status), default=0)
        per_node = scraped.targets_per_node(nodes) if scraped is not None else None
        found.append(descriptors.descriptors(view, replicas, per_node, args.prometheus_replicas))
        return found

    found = asyncio.run(main())
    sys.stdout.write(results.render_json(found) if args.output == "json" else results.render_text(found))
    return results.exit_status(found)
