"""Who may send IP packets where: per-pool CIDRs, anti-spoofing, longest-prefix routing, edge-to-edge pairs.

Pure (no I/O). Built once from configuration (with ``ipaddress``), then asked once per packet with integers
only: a :class:`PrefixTable` keeps, per IP version, one dict per prefix length mapping the network's integer to
its owner, and a lookup tries the lengths present from the longest down (a handful of dict lookups, no object
per packet).

The rules (the gateway's side of issue 12):

* a pool's **allowed CIDRs** are its configured CIDRs intersected with what its certificate allows
  (:func:`intersect`): a CIDR the certificate does not cover is narrowed to the parts it does, or dropped;
* a packet **from a pool** must have its source in that pool's allowed CIDRs, else it is dropped as
  ``spoofed``;
* its destination is looked up (longest prefix) over the cloud's CIDRs and every pool's allowed CIDRs: the
  cloud → delivered; another pool → forwarded only if the pair is allowed (``edge-to-edge-denied`` otherwise,
  pairs are unordered: allowing a↔b allows the replies); its own pool or nothing → ``no-route``;
* a packet **from the cloud** (read from the gateway's own TUN device) goes to the pool owning its destination,
  else ``no-route``.

Drop reasons are the fixed labels of :class:`Drop` (metric label values).

What is here: the drop labels, the CIDR arithmetic done once at build time, the prefix table, and the policy's
two checks (from a pool, from the cloud).
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from raven.errors import RavenError
from raven.layer3.packet import IPV4, IPV6, PacketError, addresses

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

IPV4_BITS = 32
IPV6_BITS = 128

CLOUD = ""  # the destination "the cloud" in verdicts; pool names are RFC 1123 labels, never empty


class Drop(enum.StrEnum):
    """Why a packet was dropped; the values are metric labels and never change."""

    SPOOFED = "spoofed"
    NO_ROUTE = "no-route"
    QUEUE_FULL = "queue-full"
    TOO_BIG = "too-big"
    EDGE_TO_EDGE_DENIED = "edge-to-edge-denied"
    MALFORMED = "malformed"


class PolicyError(RavenError, ValueError):
    """The policy cannot be built from these CIDRs (e.g. two pools claim overlapping ranges)."""


def network(text: str | Network) -> Network:
    """Parse a CIDR strictly (host bits must be zero), with a message naming the value."""
    if isinstance(text, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return text
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise PolicyError(f"{text!r} is not a CIDR ({exc})") from None


def intersect(configured: Iterable[str | Network], allowed: Iterable[str | Network]) -> list[Network]:
    """The parts of ``configured`` that lie inside ``allowed`` (two CIDRs overlap only by one containing the
    other, so each piece is the smaller of a pair). Sorted, duplicates and pieces inside others removed."""
    allowed_nets = [network(a) for a in allowed]
    pieces: set[Network] = set()
    for c in (network(c) for c in configured):
        for a in allowed_nets:
            if c.version != a.version:
                continue
            if c.subnet_of(a):  # type: ignore[arg-type]
                pieces.add(c)
            elif a.subnet_of(c):  # type: ignore[arg-type]
                pieces.add(a)
    return collapse(pieces)


def covers(outer: Iterable[str | Network], inner: Iterable[str | Network]) -> bool:
    """Whether every address of ``inner`` lies in ``outer`` (either may be several CIDRs, nested or not)."""
    inner_nets = collapse(network(n) for n in inner)
    return _size(intersect(inner_nets, outer)) == _size(inner_nets)


def carries_more(a: Iterable[str | Network], b: Iterable[str | Network]) -> bool:
    """Whether ``a`` holds every address of ``b`` and more."""
    a_nets, b_nets = collapse(network(n) for n in a), collapse(network(n) for n in b)
    return covers(a_nets, b_nets) and _size(a_nets) > _size(b_nets)


def _size(nets: list[Network]) -> int:
    return sum(n.num_addresses for n in collapse(nets))


def collapse(nets: Iterable[Network]) -> list[Network]:
    """Sorted, without any network contained in another of the list."""
    nets = list(nets)
    v4 = [n for n in nets if n.version == IPV4]
    v6 = [n for n in nets if n.version == IPV6]
    out: list[Network] = []
    for group in (v4, v6):
        # Two CIDRs are nested or disjoint: sorted by start (the larger first), a network that starts inside the
        # last one kept lies inside it. O(n log n): a peer's list of a thousand CIDRs costs microseconds.
        end = -1
        for n in sorted(set(group), key=lambda n: (int(n.network_address), n.prefixlen)):
            if int(n.broadcast_address) <= end:
                continue
            out.append(n)
            end = int(n.broadcast_address)
    return out


class PrefixTable:
    """Longest-prefix match from integer addresses to owners, built once, looked up per packet."""

    __slots__ = ("_tables",)

    def __init__(self, entries: Iterable[tuple[Network, str]]) -> None:
        by_version: dict[int, dict[int, dict[int, str]]] = {IPV4: {}, IPV6: {}}
        for net, owner in entries:
            bits = net.max_prefixlen
            level = by_version[net.version].setdefault(net.prefixlen, {})
            key = int(net.network_address) >> (bits - net.prefixlen)
            if level.get(key, owner) != owner:
                raise PolicyError(f"{net} is claimed by both {_name(level[key])} and {_name(owner)}")
            level[key] = owner
        # (shift, networks of that length), longest prefix first
        self._tables: dict[int, tuple[tuple[int, dict[int, str]], ...]] = {
            version: tuple(
                ((IPV4_BITS if version == IPV4 else IPV6_BITS) - plen, levels[plen])
                for plen in sorted(levels, reverse=True)
            )
            for version, levels in by_version.items()
        }

    def lookup(self, version: int, address: int) -> str | None:
        """The owner of the longest prefix holding ``address``, or None."""
        for shift, level in self._tables[version]:
            owner = level.get(address >> shift)
            if owner is not None:
                return owner
        return None


@dataclass(frozen=True)
class Verdict:
    """Where one packet goes: ``target`` is a pool name or :data:`CLOUD`; or ``drop`` says why not."""

    target: str | None
    drop: Drop | None

    @property
    def forwarded(self) -> bool:
        return self.drop is None


_DROPS = {d: Verdict(None, d) for d in Drop}
_TO_CLOUD = Verdict(CLOUD, None)


class ForwardingPolicy:
    """The gateway's forwarding policy; see the module docstring for the rules."""

    def __init__(
        self,
        cloud_cidrs: Iterable[str | Network],
        pool_cidrs: Mapping[str, Iterable[str | Network]],
        certificate_cidrs: Mapping[str, Iterable[str | Network]] | None = None,
        edge_to_edge: Iterable[tuple[str, str]] = (),
    ) -> None:
        """``pool_cidrs``: configured per pool; ``certificate_cidrs``: what each pool's certificate allows
        (a pool missing here is allowed its configured CIDRs only if ``certificate_cidrs`` is None)."""
        self.cloud = collapse(network(c) for c in cloud_cidrs)
        self.pools: dict[str, list[Network]] = {}
        for pool, cidrs in pool_cidrs.items():
            if not pool:
                raise PolicyError("a pool name is empty")
            configured = [network(c) for c in cidrs]
            if certificate_cidrs is None:
                self.pools[pool] = collapse(configured)
            else:
                self.pools[pool] = intersect(configured, certificate_cidrs.get(pool, ()))
        self.pairs: frozenset[tuple[str, str]] = frozenset()
        pairs: set[tuple[str, str]] = set()
        for a, b in edge_to_edge:
            for p in (a, b):
                if p not in self.pools:
                    raise PolicyError(f"edge-to-edge pair ({a}, {b}) names unknown pool {p!r}")
            if a == b:
                raise PolicyError(f"edge-to-edge pair ({a}, {b}) names the same pool twice")
            pairs.update({(a, b), (b, a)})
        self.pairs = frozenset(pairs)
        self._routes = PrefixTable(
            [(n, CLOUD) for n in self.cloud] + [(n, p) for p, nets in self.pools.items() for n in nets]
        )
        self._sources = {pool: PrefixTable((n, pool) for n in nets) for pool, nets in self.pools.items()}
        self._verdicts = {p: Verdict(p, None) for p in self.pools}
        self._check_overlaps()

    def _check_overlaps(self) -> None:
        owners = [(n, CLOUD) for n in self.cloud] + [(n, p) for p, nets in self.pools.items() for n in nets]
        # Nested or disjoint: sorted by (version, start, larger first), a network overlaps an earlier one only by
        # lying inside the enclosing one still open; it must have that one's owner. O(n log n).
        owners.sort(key=lambda item: (item[0].version, int(item[0].network_address), item[0].prefixlen))
        enclosing: tuple[Network, str] | None = None
        for net, owner in owners:
            if enclosing is not None:
                outer, outer_owner = enclosing
                if outer.version == net.version and int(net.network_address) <= int(outer.broadcast_address):
                    if owner != outer_owner:
                        raise PolicyError(f"{outer} ({_name(outer_owner)}) overlaps {net} ({_name(owner)}): a "
                                          "destination must have one owner")
                    continue
            enclosing = (net, owner)

    def allowed(self, pool: str) -> list[Network]:
        """The CIDRs the gateway routes to ``pool`` (config ∩ certificate)."""
        return list(self.pools.get(pool, ()))

    def from_pool(self, pool: str, packet: bytes | bytearray | memoryview) -> Verdict:
        """Decide on a packet an agent of ``pool`` sent up the tunnel."""
        try:
            version, src, dst = addresses(packet)
        except PacketError:
            return _DROPS[Drop.MALFORMED]
        sources = self._sources.get(pool)
        if sources is None or sources.lookup(version, src) is None:
            return _DROPS[Drop.SPOOFED]
        owner = self._routes.lookup(version, dst)
        if owner is None or owner == pool:
            return _DROPS[Drop.NO_ROUTE]
        if owner == CLOUD:
            return _TO_CLOUD
        if (pool, owner) not in self.pairs:
            return _DROPS[Drop.EDGE_TO_EDGE_DENIED]
        return self._verdicts[owner]

    def from_cloud(self, packet: bytes | bytearray | memoryview, local: PrefixTable | None = None) -> Verdict:
        """Decide on a packet read from the gateway's own TUN device (sent by the cloud side's kernel): its source
        must be the cloud's (``cloud_cidrs``, or an address in ``local``: the device's own), else ``spoofed``
        (whoever can route through the gateway node must not reach the pools with any source it likes)."""
        try:
            version, src, dst = addresses(packet)
        except PacketError:
            return _DROPS[Drop.MALFORMED]
        if self._routes.lookup(version, src) != CLOUD and (local is None or local.lookup(version, src) is None):
            return _DROPS[Drop.SPOOFED]
        owner = self._routes.lookup(version, dst)
        if owner is None or owner == CLOUD:
            return _DROPS[Drop.NO_ROUTE]
        return self._verdicts[owner]


def _name(owner: str) -> str:
    return "the cloud" if owner == CLOUD else f"pool {owner}"
