"""The hosts file that CoreDNS's hosts plugin (or dnsmasq's --addn-hosts) serves.

One source of truth renders the whole file: every edge node name, exactly (no suffix
matching: ``edge-1`` and ``myedge-1`` are different names), sorted, one line per node and
service address (IPv4 and IPv6), pointing at the Raven front Service. The content holds
no timestamp, so it changes only when the set of nodes or addresses changes.
"""

from __future__ import annotations

import bisect
import ipaddress
import itertools
import operator
import re
from collections.abc import Iterable, Mapping, Sequence

from raven.names import LABEL, MAX_NAME
from raven.protocol import wire

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# A ConfigMap's data may hold at most 1 MiB (etcd's object limit): the hosts file must fit in it.
CONFIGMAP_MAX_BYTES = 1024 * 1024 - 8 * 1024  # what is left after the object's metadata
HEADER_ROOM = 4096  # bytes of a file kept for its comment lines
NAMES_ROOM = CONFIGMAP_MAX_BYTES - HEADER_ROOM  # bytes of one ConfigMap's file its name lines may take


# Names are checked in batches with one regular expression over the batch joined by newlines: one C call for a few
# thousand names instead of a Python call each (raven/names.py's label, the same grammar as wire.valid_node_name:
# possessive, so it matches exactly what the per-name check does).
_NAMES = re.compile(rf"(?:{LABEL}(?:\.{LABEL})*+\n)*+")
_BATCH = 4096  # names per regular expression call: each holds the GIL for ~1 ms at most


def check_names(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """``names`` sorted without duplicates, split into those the hosts file can carry (RFC 1123, lower case, at
    most 253 characters) and those it cannot."""
    unique = sorted(names)  # in one pass when sorted already, as the publisher's names are
    if any(map(operator.eq, unique, itertools.islice(unique, 1, None))):
        unique = list(dict.fromkeys(unique))
    if not unique:
        return [], []
    bad: list[str] = []
    for start in range(0, len(unique), _BATCH):
        batch = unique[start:start + _BATCH]
        text = "\n".join(batch) + "\n"
        if (text.count("\n") == len(batch) and max(map(len, batch)) <= MAX_NAME
                and _NAMES.fullmatch(text) is not None):
            continue
        bad.extend(name for name in batch if not wire.valid_node_name(name))
    if not bad:
        return unique, []
    refused = set(bad)
    return [name for name in unique if name not in refused], bad


def service_addresses(addresses: Iterable[str]) -> list[Address]:
    """The service addresses parsed, IPv4 first, in the order the hosts file lists them."""
    addrs = []
    for a in addresses:
        try:
            addrs.append(ipaddress.ip_address(a))
        except ValueError:
            raise ValueError(f"{a!r} is not an IPv4 or IPv6 address") from None
    return sorted(addrs, key=lambda ip: (ip.version, ip))


def render(names: Iterable[str], addresses: Sequence[str], writer: str = "raven gateway",
           direct: Mapping[str, str] | None = None) -> str:
    """The whole hosts file. Raises ValueError for an invalid name or address.

    ``direct``: names of pools scraped without the tunnel, each mapped to its own node's address
    (``hosts.direct: internal-ip``); a name in both is the tunnel's.
    """
    ordered = service_addresses(addresses)
    unique, bad = check_names(names)
    if bad:
        raise ValueError(f"{bad[0]!r} is not a valid RFC 1123 node name")
    return render_checked(unique, ordered, writer, direct)


def render_checked(unique: Sequence[str], ordered: Sequence[Address], writer: str = "raven gateway",
                   direct: Mapping[str, str] | None = None) -> str:
    """:func:`render` of names already through :func:`check_names` (sorted, unique, valid) and addresses through
    :func:`service_addresses`: what the publisher runs in a worker thread."""
    lines = [
        f"# Edge node names served through the Raven tunnel. Written by {writer}; do not edit:",
        "# every write replaces the whole file.",
        f"# {len(unique)} node(s) -> {', '.join(str(a) for a in ordered) or 'no service address configured'}",
    ]
    own: dict[str, str] = {}
    for name, address in (direct or {}).items():
        at = bisect.bisect_left(unique, name)
        if (at < len(unique) and unique[at] == name) or not wire.valid_node_name(name):
            continue
        try:
            own[name] = str(ipaddress.ip_address(address))
        except ValueError:
            raise ValueError(f"{address!r} (node {name!r}) is not an IPv4 or IPv6 address") from None
    if own:
        lines.append(f"# {len(own)} node(s) of direct and layer3 pools -> their own addresses")
    # One line per name and service address, "\n<address>\t" then the name: the file is one join of strings that
    # exist already (each address formatted once: an IPv6 address's str() is slow), whose list is built by slice
    # assignment, column by column: no Python step and no new string per line.
    step = 2 * len(ordered)
    parts: list[str] = [""] * (step * len(unique))
    for column, ip in enumerate(ordered):
        parts[2 * column::step] = [f"\n{ip}\t"] * len(unique)
        parts[2 * column + 1::step] = unique
    if own:  # each direct name's line goes between the tunnel names around it (none is both)
        merged: list[str] = []
        done = 0
        for name in sorted(own):
            at = bisect.bisect_left(unique, name, done)
            merged += parts[done * step:at * step]
            merged += (f"\n{own[name]}\t", name)
            done = at
        merged += parts[done * step:]
        parts = merged
    return "\n".join(lines) + "".join(parts) + "\n"
