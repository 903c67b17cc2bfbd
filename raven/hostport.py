"""Hosts and ports as text: an address as a URL or a ``Host`` header writes it (an IPv6 address in brackets), and
a ``HOST:PORT`` listen address read back."""

from __future__ import annotations


def url_host(address: str) -> str:
    """``address`` as the host part of a URL or a ``Host`` header: an IPv6 address bracketed (once), anything else
    as it is."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def split_host_port(value: str) -> tuple[str, int]:
    """A checked ``HOST:PORT`` (raven.config.base.HostPort) as (host without brackets, port); no host: all IPv4."""
    host, _, port = value.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)
