"""The name-resolution check of ``raven check``: a sample of the edge names in the published hosts file, asked of
the cluster's DNS (the kube-dns Service, or ``--dns-server``), must resolve to the front Service's address.
:func:`raven.dns.check.check_all` does the asking.
"""

from __future__ import annotations

from raven.check.checks import hosts_entries
from raven.check.reader import ClusterView
from raven.check.results import Result, failed, passed
from raven.dns.check import check_all
from raven.errors import CheckError

SAMPLE = 3
NAME = "dns-sample"


def sample_names(view: ClusterView, count: int = SAMPLE) -> list[str]:
    """Edge names the hosts file sends to the Service (not a direct pool's, listed at the node's own address)."""
    return sorted({name for _, name in hosts_entries(view)})[:count]


def _cluster_ip(svc: dict[str, object] | None) -> str | None:
    spec = (svc or {}).get("spec")
    ip = spec.get("clusterIP") if isinstance(spec, dict) else None
    return str(ip) if ip and ip != "None" else None


async def dns_sample(view: ClusterView, server: str | None, timeout: float) -> Result:
    names = sample_names(view)
    if not names:
        return passed(NAME, "no edge name published yet: nothing to resolve")
    expected = _cluster_ip(view.front_service)
    server = server or _cluster_ip(view.dns_service)
    if expected is None or server is None:
        what = "the Service raven-gateway" if expected is None else "the Service kube-dns"
        return failed(NAME, f"cannot tell where to ask: {what} has no ClusterIP", "pass --dns-server ADDR[:PORT]")
    try:
        results = await check_all(names, [expected], server, timeout=min(timeout, 5.0))
    except CheckError as exc:
        return failed(NAME, str(exc), "pass --dns-server ADDR[:PORT]")
    bad = [r for r in results if not r.ok]
    if bad and all(r.no_answer for r in bad):
        return failed(NAME, f"the DNS server {server} did not answer",
                      "run raven check in a pod (the cluster DNS is reachable there), or pass --dns-server")
    if bad:
        got = "; ".join(f"{r.name}: {r.error or ', '.join(r.got) or 'no address'}" for r in bad)
        return failed(NAME, f"{got} (expected {expected}) via {server}",
                      "CoreDNS does not serve the hosts file yet: see coredns-mount and coredns-corefile; the "
                      "kubelet refreshes the mount within a minute, then raven dns check --gateway ... --server "
                      f"{server}")
    return passed(NAME, f"{', '.join(names)} resolve to {expected} via {server}")
