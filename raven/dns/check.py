"""`raven dns check`: does every edge node name resolve to the Raven service address?"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

from raven.errors import CheckError


@dataclass(frozen=True)
class Check:
    name: str
    expected: tuple[str, ...]
    got: tuple[str, ...]
    error: str = ""
    no_answer: bool = False  # the server did not answer at all (timeout), as opposed to a wrong answer

    @property
    def ok(self) -> bool:
        return not self.error and set(self.got) == set(self.expected)


def parse_server(server: str) -> tuple[str, int]:
    """``ADDR``, ``ADDR:PORT`` or ``[V6]:PORT`` -> (address, port); the address must be an IP."""
    host, sep, port = server.rpartition(":")
    if not sep or "]" in port or (":" in host and not host.startswith("[")):
        host, port = server, "53"  # a bare address (IPv4, or IPv6 without brackets)
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise CheckError(f"--server must be an IP address (optionally :PORT), got {server!r}") from None
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise CheckError(f"bad port in --server {server!r}")
    return host, int(port)


def _resolver(server: str, timeout: float) -> dns.asyncresolver.Resolver:
    host, port = parse_server(server)
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host]
    resolver.port = port
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
        except dns.exception.Timeout:
            return Check(name, tuple(expected), tuple(got), f"{rdtype} query: no answer from the server in time",
                         no_answer=True)
        except dns.exception.DNSException as exc:
            return Check(name, tuple(expected), tuple(got), f"{rdtype} query failed: {exc}")
    return Check(name, tuple(expected), tuple(sorted(got)))


async def check_all(names: Sequence[str], expected: Sequence[str], server: str, timeout: float = 3.0,
                    concurrency: int = 32) -> list[Check]:
    for address in expected:
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise CheckError(f"{address!r} is not an IPv4 or IPv6 address") from None
    resolver = _resolver(server, timeout)
    gate = asyncio.Semaphore(concurrency)

    async def one(name: str) -> Check:
        async with gate:
            return await check_name(resolver, name, expected)

    return list(await asyncio.gather(*(one(n) for n in sorted(set(names)))))
