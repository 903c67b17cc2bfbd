"""The ``layer3:`` configuration sections: the gateway's, the agent's, and ``raven routes``'s.

Pydantic v2 models in the style of :mod:`raven.config` (frozen, unknown keys refused, one description per
field); a bad value fails with a message naming the field, e.g.
``layer3.pools.site-a.cidrs.0: '10.1.0.1/16' has host bits set (did you mean 10.1.0.0/16?)``.
:func:`parse` validates a section and raises :class:`~raven.errors.ConfigError` with one line per problem.

**The default MTU.** IP packets travel inside the tunnel: each one is a Raven frame in a binary WebSocket
message in a TLS record in TCP over IP. The default is chosen so that one full-size inner packet with all its
framing fits in one outer TCP segment of a 1500-byte path, whether that path is IPv4 or IPv6 and whether TCP
timestamps are on (the worst case counts)::

    1500  outer path MTU (Ethernet)
    - 40  outer IPv6 header (IPv4: 20)
    - 20  outer TCP header
    - 12  TCP timestamp option (Linux default)
    - 22  TLS 1.3 record: 5 header + 1 inner content type + 16 AEAD tag
    -  8  WebSocket frame header, client to server, 126..65535-byte payload: 2 + 2 extended length + 4 mask
    -  6  Raven frame header (type, flags, 32-bit id; raven.protocol.wire.HEADER_SIZE)
    = 1392 (a multiple of 8)

Over TCP a larger packet would still arrive (it spans two segments); the reason to stay within one segment is
that a lone packet (a ping, an ACK, a small request) then costs one segment and one TLS record, not two, and that
the packets leave the far end onto ordinary 1500-byte networks without fragmentation. Where both ends' networks
carry jumbo frames, raise ``mtu`` (up to 65535): fewer, larger packets cost less per byte.

What is here: the MTU arithmetic, the field types with their checks, the gateway's, the agent's and the routes
command's sections, and the wording of their errors.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, Field, ValidationError, model_validator

from raven.errors import ConfigError
from raven.layer3.policy import ForwardingPolicy, PolicyError
from raven.layer3.tun import DEFAULT_BATCH, DEFAULT_DEVICE, MAX_BATCH, valid_device_name
from raven.model import Model
from raven.names import PoolName
from raven.unknownkeys import EXTRA, unknown_setting

# ---------------------------------------------------------------- the MTU arithmetic (see the docstring)

PATH_MTU = 1500
OUTER_IP = 40  # IPv6, the larger of the two
OUTER_TCP = 20
TCP_TIMESTAMPS = 12
TLS13_RECORD = 5 + 1 + 16
WEBSOCKET_HEADER = 2 + 2 + 4
RAVEN_FRAME_HEADER = 6
TUNNEL_OVERHEAD = OUTER_IP + OUTER_TCP + TCP_TIMESTAMPS + TLS13_RECORD + WEBSOCKET_HEADER + RAVEN_FRAME_HEADER
DEFAULT_MTU = (PATH_MTU - TUNNEL_OVERHEAD) // 8 * 8  # 1392
IPV6_MIN_MTU = 1280

# ---------------------------------------------------------------- what Raven installs (docs/layer3.md)

RAVEN_TABLE = 0x5241  # 21057 ("RA"): Raven's own routing table on non-gateway nodes
RAVEN_RULE_PRIORITY = 0x5241  # 21057: before the main table's rule (32766), after the local table's (0)
RAVEN_PROTO = 0x52  # 82 ("R"): the rtm_protocol marking every route Raven installs, so that it finds its own
RESERVED_TABLES = {0: "unspec", 253: "default", 254: "main", 255: "local"}


def _cidr(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except ValueError:
        pass
    try:
        loose = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not a CIDR (e.g. 10.1.0.0/16)") from None
    raise ValueError(f"{value!r} has host bits set (did you mean {loose}?)")


def _interface(value: str) -> str:
    if "/" not in value:
        raise ValueError(f"{value!r} needs a prefix length (e.g. 10.77.0.1/24)")
    try:
        iface = ipaddress.ip_interface(value)
    except ValueError:
        raise ValueError(f"{value!r} is not ADDRESS/PREFIX (e.g. 10.77.0.1/24)") from None
    if iface.ip == iface.network.network_address and iface.network.num_addresses > 2:
        raise ValueError(f"{value!r} is the network's own address; use a host address in {iface.network}")
    return str(iface)


def _device(value: str) -> str:
    if not valid_device_name(value):
        raise ValueError(f"{value!r} is not a valid device name (1-15 characters, no '/', ':' or spaces)")
    return value


def _ip(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 or IPv6 address") from None


def _table(value: int) -> int:
    if value in RESERVED_TABLES:
        raise ValueError(f"table {value} is the kernel's {RESERVED_TABLES[value]!r} table; choose another")
    return value


CIDR = Annotated[str, AfterValidator(_cidr)]
Interface = Annotated[str, AfterValidator(_interface)]
DeviceName = Annotated[str, AfterValidator(_device)]
IPAddress = Annotated[str, AfterValidator(_ip)]
MTU = Annotated[int, Field(ge=576, le=65535, description="MTU of the TUN device; default derived from the "
                                                           "tunnel's overhead (docs/layer3.md)")]
Table = Annotated[int, Field(ge=1, le=2**32 - 1), AfterValidator(_table)]
Seconds = Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)]


def _v6(values: list[str]) -> bool:
    return any(":" in v for v in values)


def _check_mtu(mtu: int, *values: list[str]) -> None:
    if mtu < IPV6_MIN_MTU and any(_v6(v) for v in values):
        raise ValueError(f"mtu: {mtu} is below {IPV6_MIN_MTU}, the least IPv6 allows, and IPv6 is configured")


def _unique(name: str, values: list[str]) -> None:
    seen: set[str] = set()
    for v in values:
        if v in seen:
            raise ValueError(f"{name}: {v} is listed twice")
        seen.add(v)


class PoolLayer3(Model):
    cidrs: list[CIDR] = Field(
        min_length=1, description="the pool's node and pod ranges; routed to the pool only where its certificate "
        "allows them too",
    )


class GatewayLayer3Settings(Model):
    enabled: bool = Field(False, description="carry IP packets between the cloud and the pools (needs CAP_NET_ADMIN)")
    device: DeviceName = Field(DEFAULT_DEVICE, description="name of the TUN device")
    mtu: MTU = DEFAULT_MTU
    addresses: list[Interface] = Field(
        default_factory=list, description="addresses of the TUN device, ADDRESS/PREFIX (IPv4 and/or IPv6)",
    )
    cloud_cidrs: list[CIDR] = Field(
        default_factory=list, description="the cloud's ranges (pods, nodes, services) that the pools may reach",
    )
    pools: dict[PoolName, PoolLayer3] = Field(default_factory=dict, description="per pool: its CIDRs")
    edge_to_edge: list[tuple[PoolName, PoolName]] = Field(
        default_factory=list,
        description="pool pairs allowed to reach each other through the cloud (both ways); none by default",
    )
    batch: int = Field(DEFAULT_BATCH, ge=1, le=MAX_BATCH, description="packets read from the device per loop turn")
    manage_sysctls: bool = Field(
        True, description="set net.ipv4.ip_forward (and IPv6 forwarding) and loose rp_filter on the device, "
        "restored on exit where Raven changed them",
    )

    @model_validator(mode="after")
    def _consistent(self) -> GatewayLayer3Settings:
        if self.enabled and not self.addresses:
            raise ValueError("addresses: layer 3 is enabled but the device has no address")
        _unique("cloud_cidrs", self.cloud_cidrs)
        _check_mtu(self.mtu, self.addresses, self.cloud_cidrs, *[p.cidrs for p in self.pools.values()])
        for a, b in self.edge_to_edge:
            for p in (a, b):
                if p not in self.pools:
                    raise ValueError(f"edge_to_edge: ({a}, {b}) names {p!r}, which is not in pools")
            if a == b:
                raise ValueError(f"edge_to_edge: ({a}, {b}) names the same pool twice")
        try:
            policy = self.policy()
        except PolicyError as exc:
            raise ValueError(f"pools: {exc}") from None
        for address in self.addresses:
            ip = ipaddress.ip_interface(address).ip
            for pool, nets in policy.pools.items():
                if any(ip in n for n in nets):
                    raise ValueError(f"addresses: {address} lies in pool {pool}'s CIDRs; use an address of the cloud")
        return self

    def policy(self, certificate_cidrs: Mapping[str, list[str]] | None = None) -> ForwardingPolicy:
        """The forwarding policy; ``certificate_cidrs`` (per pool, from its certificate) narrows the pools'."""
        return ForwardingPolicy(
            self.cloud_cidrs, {p: c.cidrs for p, c in self.pools.items()}, certificate_cidrs, self.edge_to_edge,
        )


class AgentLayer3Settings(Model):
    enabled: bool = Field(False, description="carry IP packets for this pool (needs CAP_NET_ADMIN)")
    device: DeviceName = Field(DEFAULT_DEVICE, description="name of the TUN device")
    mtu: MTU = DEFAULT_MTU
    addresses: list[Interface] = Field(
        default_factory=list, description="addresses of the TUN device, ADDRESS/PREFIX (IPv4 and/or IPv6)",
    )
    cidrs: list[CIDR] = Field(
        default_factory=list, max_length=64,
        description="the ranges this agent announces for its pool (nodes, pods); at most 64",
    )
    accept_cidrs: list[CIDR] = Field(
        default_factory=list,
        description="the ranges a gateway may route through this agent's device (its offer is narrowed to them); "
        "empty: what it offers, except anything broader than /8 (IPv4) or /16 (IPv6)",
    )
    batch: int = Field(DEFAULT_BATCH, ge=1, le=MAX_BATCH, description="packets read from the device per loop turn")
    manage_sysctls: bool = Field(
        True, description="set ip_forward and loose rp_filter on the device, restored on exit where Raven changed them",
    )
    lan_address: Interface | None = Field(
        None, description="the pool's floating address on the gateway nodes' network, ADDRESS/PREFIX (IPv4): the "
        "active agent's node holds it and announces it (gratuitous ARP), so that 'raven routes --gateway ADDRESS' "
        "on the other nodes follows the active agent from node to node; needs CAP_NET_RAW too",
    )
    lan_device: DeviceName | None = Field(
        None, description="the device that gets lan_address; default: the one with an address in its network",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AgentLayer3Settings:
        if self.enabled and not self.addresses:
            raise ValueError("addresses: layer 3 is enabled but the device has no address")
        if self.enabled and not self.cidrs:
            raise ValueError("cidrs: layer 3 is enabled but the agent announces no CIDR")
        _unique("cidrs", self.cidrs)
        if self.lan_address is not None:
            lan = ipaddress.ip_interface(self.lan_address)
            if lan.version != 4:
                raise ValueError(f"lan_address: {self.lan_address} is IPv6; only IPv4 floating addresses are "
                                 "supported (announced by gratuitous ARP)")
            if lan.network.prefixlen > 30:
                raise ValueError(f"lan_address: {self.lan_address} needs the prefix of the nodes' network "
                                 "(e.g. /24), not a host prefix")
            if lan.ip == lan.network.broadcast_address:
                raise ValueError(f"lan_address: {self.lan_address} is the network's broadcast address")
            if any(lan.ip == ipaddress.ip_interface(a).ip for a in self.addresses):
                raise ValueError(f"lan_address: {lan.ip} is also an address of the TUN device")
        elif self.lan_device is not None:
            raise ValueError("lan_device: set without lan_address")
        _check_mtu(self.mtu, self.addresses, self.cidrs)
        return self


class RoutesLayer3(Model):
    """``raven routes``: send the remote CIDRs to the local gateway node (Raven's own table and rule)."""

    gateway: IPAddress = Field(description="the local gateway node's address (on this node's network)")
    cidrs: list[CIDR] = Field(min_length=1, description="remote ranges to route through the gateway node")
    table: Table = Field(RAVEN_TABLE, description="Raven's routing table id")
    priority: int = Field(
        RAVEN_RULE_PRIORITY, ge=1, le=32765,
        description="priority of the rule 'from all lookup <table>' (below 32766, the main table's, to take effect)",
    )
    interval: Seconds = Field(30.0, description="how often to check the routes and the rule again")
    timeout: Seconds = Field(10.0, description="deadline of one check (netlink calls)")

    @model_validator(mode="after")
    def _consistent(self) -> RoutesLayer3:
        _unique("cidrs", self.cidrs)
        gateway = ipaddress.ip_address(self.gateway)
        for cidr in self.cidrs:
            net = ipaddress.ip_network(cidr)
            if net.version != gateway.version:
                raise ValueError(
                    f"cidrs: {cidr} is IPv{net.version} but gateway {self.gateway} is IPv{gateway.version}"
                )
            if gateway in net:
                raise ValueError(f"cidrs: {cidr} holds the gateway {self.gateway} itself (a routing loop)")
        return self


M = TypeVar("M", bound=BaseModel)
_NAMED = re.compile(r"([a-z_]+): (.*)", re.DOTALL)


def parse(model: type[M], data: Any, where: str = "layer3") -> M:
    """Validate one section; a problem raises ConfigError with one line per field, named from ``where``."""
    try:
        return model.model_validate({} if data is None else data)
    except ValidationError as err:
        lines = [f"invalid configuration ({where}):"]
        for e in err.errors():
            loc = ".".join(str(p) for p in (where, *e["loc"]))
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] == EXTRA:  # a typo: the section and the nearest setting, not pydantic's "Extra inputs"
                msg = unknown_setting(model, e["loc"], (where,))
            named = _NAMED.match(msg)
            if named:  # a model-level message names its field first: "cidrs: ..."
                loc, msg = f"{loc}.{named[1]}", named[2]
            lines.append(f"  {loc}: {msg}")
        raise ConfigError("\n".join(lines)) from None
