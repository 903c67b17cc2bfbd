"""``raven install``: print a whole installation for one cluster as one YAML stream, from a few answers.

    raven install --service-address 10.96.0.100 --pool pool-a --pool pool-b \\
        --image registry.example.com/raven/raven-tunnel:0.2.0 | kubectl apply -f -

The work is in raven/install/ (answers, the rendered kustomization, the secret files); this module is the
command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from raven import version
from raven.errors import UsageError
from raven.install import answers as answers_mod
from raven.install import coredns, render, secrets

DESCRIPTION = """\
Print everything Raven needs in one cluster as one YAML stream, ready for `kubectl apply -f -`: the gateways,
one agent Deployment per tunnel or layer-3 pool, cert-manager's Issuer and Certificates (or Secrets from Raven's
own CA), and the monitoring objects. It renders the kustomizations shipped in deploy/ and certs/manifests/ with
`kubectl kustomize`, patched with your answers. The bearer token and the CA are kept in --secrets-dir (made
there once, reused after); Secrets are printed only with --with-secrets, otherwise the commands that create
them from those files are written to standard error.

Answers come from --answers FILE (YAML; see raven/install/answers.py for every key) and/or the flags below.
With --coredns, the cluster's CoreDNS Deployment and ConfigMap are printed too, with Raven's hosts file
mounted and served (otherwise patch CoreDNS by hand: deploy/coredns/README.md). Then run `raven check`."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("install", help="print the whole installation for one cluster (kubectl apply -f -)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--answers", "-f", type=Path, metavar="FILE", help="YAML file of answers (flags override it)")
    p.add_argument("--service-address", metavar="IP",
                   help="a free ClusterIP in the service CIDR for the front Service; every edge name resolves to it")
    p.add_argument("--pool", action="append", default=[], metavar="NAME[=REACH]",
                   help="a pool (reach tunnel, direct or layer3; default tunnel); repeatable. Nodes are selected by "
                   "--pool-label=NAME (the answers file can give each pool its own node_selector)")
    p.add_argument("--pool-label", metavar="KEY", help="the Node label naming a node's pool "
                   "(default apps.openyurt.io/nodepool)")
    p.add_argument("--image", metavar="REF", help="the Raven image, REPOSITORY:TAG or @sha256:DIGEST")
    p.add_argument("--certificates", choices=["cert-manager", "raven"],
                   help="who issues the certificates: cert-manager (default; needs it in the cluster) or Raven's own "
                   "CA (certificates issued into --secrets-dir)")
    p.add_argument("--monitoring", choices=["operator", "prometheus", "none"],
                   help="operator (default): ServiceMonitor, PodMonitor, ScrapeConfigs, PrometheusRule; prometheus: a "
                   "ConfigMap with the scrape jobs and rules for a plain Prometheus; none")
    p.add_argument("--layer3", action="store_true", default=None, help="gateways with layer 3 (docs/layer3.md)")
    p.add_argument("--secrets-dir", type=Path, default=Path("raven-secrets"), metavar="DIR",
                   help="where the token, the CA (and Raven-issued certificates) are kept (default ./raven-secrets; "
                   "mode 0700; never commit it)")
    p.add_argument("--with-secrets", action="store_true",
                   help="print the Secrets too (their contents: keep the output private)")
    p.add_argument("--coredns", metavar="FILE",
                   help="also print the cluster's CoreDNS Deployment and ConfigMap with Raven's hosts file mounted and "
                   "served, from FILE ('-': standard input), the output of: kubectl -n kube-system get "
                   "deployment,configmap coredns -o yaml")
    p.add_argument("--kubectl", metavar="PATH", help="the kubectl to render with (kustomize v5)")
    p.add_argument("--source", type=Path, metavar="DIR", help="a Raven checkout holding deploy/ and certs/ "
                   "(default: the one this raven runs from)")
    p.set_defaults(func=cmd_install)


def _flags(args: argparse.Namespace) -> dict[str, object]:
    return {
        "service_address": args.service_address,
        "image": args.image,
        "certificates": args.certificates,
        "monitoring": args.monitoring,
        "layer3": args.layer3,
        "pool_label": args.pool_label,
        "pools": [answers_mod.parse_pool_flag(p) for p in args.pool],
    }


def _read_input(name: str) -> str:
    try:
        if name == "-":
            return sys.stdin.read(coredns.MAX_INPUT + 1)
        with open(name, encoding="utf-8") as f:
            return f.read(coredns.MAX_INPUT + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --coredns {name!r}: {exc}") from None


def cmd_install(args: argparse.Namespace) -> int:
    answers = answers_mod.load(args.answers, _flags(args))
    root = (args.source or render.source_root()).resolve()
    kubectl_path = render.kubectl(args.kubectl)
    dns_objects = coredns.render(_read_input(args.coredns), root) if args.coredns else []
    made = secrets.ensure_files(answers, args.secrets_dir, render.gateway_dns_names(root))
    stream = render.render(answers, root, kubectl_path)
    needed = secrets.specs(answers, args.secrets_dir)
    pools = ", ".join(f"{p.name} ({p.reach})" for p in answers.pools)
    out = [f"# raven install (raven {version.RELEASE}): service address {answers.service_address}; pools {pools}; "
           f"image {answers.image}; certificates {answers.certificates}; monitoring {answers.monitoring}; "
           f"layer 3 {'on' if answers.layer3 else 'off'}\n", stream]
    if args.with_secrets:
        for spec in needed:
            out.append("---\n" + yaml.safe_dump(secrets.secret_object(spec), sort_keys=True))
    for obj in dns_objects:
        out.append("---\n" + yaml.safe_dump(obj, sort_keys=True))
    sys.stdout.write("".join(out))
    for path in made:
        print(f"raven install: made {path}", file=sys.stderr)
    if not args.with_secrets:
        print("raven install: the Secrets are not in the output; create them from the files in "
              f"{args.secrets_dir} (or rerun with --with-secrets):", file=sys.stderr)
        for line in secrets.secret_commands(needed):
            print(f"  {line}", file=sys.stderr)
    if not args.coredns:
        print("raven install: then patch CoreDNS (--coredns, or deploy/coredns/README.md)", file=sys.stderr)
    print("raven install: then run: raven check", file=sys.stderr)
    return 0
