"""`raven dns check`: does every edge node name resolve to the Raven service address?"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver


@dataclass(frozen=True)
class Check:
    name: str
    expected: tuple[str, ...]
    got: tuple[str, ...]
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and set(self.got) == set(self.expected)


def _resolver(server: str, timeout: float) -> dns.asyncresolver.Resolver:
    host, sep, port = server.rpartition(":")
    if not sep or "]" in port or (":" in host and not host.startswith("[")):
        host, port = server, "53"  # a bare address (IPv4, or IPv6 without brackets)
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host.strip("[]")]
    resolver.port = int(port)
    resolver.lifetime = timeout
    return resolver


async def check_name(resolver: dns.asyncresolver.Resolver, name: str, expected: Sequence[str]) -> Check:
    families = {ipaddress.ip_address(a).version for a in expected} or {4}
    got: list[str] = []
    for version, rdtype in ((4, "A"), (6, "AAAA")):
        if version not in families:
            continue
        try:
            # The name exactly as given: no search domains, as Prometheus's resolver would ask.
            answer = await resolver.resolve(name + ".", rdtype, search=False)
            got.extend(rr.to_text() for rr in answer)
        except dns.resolver.NXDOMAIN:
            return Check(name, tuple(expected), tuple(got), "no such name (NXDOMAIN)")
        except dns.resolver.NoAnswer:
            continue
        except dns.exception.DNSException as exc:
            return Check(name, tuple(expected), tuple(got), f"{rdtype} query failed: {exc}")
    return Check(name, tuple(expected), tuple(sorted(got)))


async def check_all(names: Sequence[str], expected: Sequence[str], server: str, timeout: float = 3.0,
                    concurrency: int = 32) -> list[Check]:
    resolver = _resolver(server, timeout)
    gate = asyncio.Semaphore(concurrency)

    async def one(name: str) -> Check:
        async with gate:
            return await check_name(resolver, name, expected)

    return list(await asyncio.gather(*(one(n) for n in sorted(set(names)))))
