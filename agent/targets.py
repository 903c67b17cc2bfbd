"""Where the agent dials: every address of the gateway's name, or one load-balanced address.

A name that resolves to several addresses (a Kubernetes headless Service) gives one dial
target per address: the agent keeps one session to each and re-resolves periodically to
follow scale-up and scale-down. A name with one address (a load balancer) or an IP
literal gives a single target, which the agent dials until it holds sessions to as many
distinct replicas as the gateway's WELCOME says exist.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import dns.asyncresolver
import dns.exception
import dns.resolver

from raven.hostport import url_host

log = logging.getLogger("raven.agent.targets")


@dataclass(frozen=True, slots=True)
class DialTarget:
    key: str  # stable identity: the address, or the URL's host for a single target
    url: str  # what to connect to
    server_hostname: str  # name verified in the gateway's certificate (and sent as SNI)


@dataclass(frozen=True, slots=True)
class Resolution:
    targets: tuple[DialTarget, ...]
    per_address: bool  # True: one session per target; False: one target, as many sessions as replicas


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _with_host(url: str, address: str) -> str:
    parts = urlsplit(url)
    host = url_host(address)
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


async def _dns_addresses(host: str, nameserver: str | None, timeout: float) -> list[str]:
    resolver = dns.asyncresolver.Resolver(configure=nameserver is None)
    if nameserver is not None:
        server, _, port = nameserver.rpartition(":")
        resolver.nameservers = [server.strip("[]") or nameserver]
        if port.isdigit():
            resolver.port = int(port)
    resolver.lifetime = timeout
    addresses: list[str] = []
    failure: dns.exception.DNSException | None = None
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(host, rdtype, search=True)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        except dns.exception.DNSException as exc:
            # Some servers refuse or fail one record type only (AAAA, typically): use the other.
            failure = exc
            continue
        addresses.extend(rr.to_text() for rr in answer)
    if not addresses and failure is not None:
        raise failure
    return addresses


async def _system_addresses(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def resolve(url: str, server_name: str | None, nameserver: str | None, timeout: float = 5.0) -> Resolution:
    """Turn the gateway URL into dial targets. Raises OSError when the name does not resolve."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    verify = server_name or host
    if _is_ip(host):
        return Resolution((DialTarget(host, url, verify),), per_address=False)
    try:
        addresses = await _dns_addresses(host, nameserver, timeout)
    except dns.exception.DNSException as exc:
        if nameserver is not None:
            raise OSError(f"cannot resolve {host} with DNS server {nameserver}: {exc}") from None
        addresses = []
    if not addresses and nameserver is None:
        # Names only the system knows (/etc/hosts, search domains handled by libc).
        addresses = await _system_addresses(host, parts.port or 443)
    unique = sorted(set(addresses))
    if not unique:
        raise OSError(f"{host} resolves to no address")
    if len(unique) == 1:
        return Resolution((DialTarget(host, url, verify),), per_address=False)
    return Resolution(tuple(DialTarget(a, _with_host(url, a), verify) for a in unique), per_address=True)
