"""The control frames (stream 0), each with its encoder and its decoder beside it. HELLO, WELCOME, REGISTER,
REGISTERED and ROUTES carry compact JSON objects (a decoder reads the keys it knows, so a newer peer may add
some); PING, PONG, DRAIN, GOAWAY and DATAGRAM are binary. A decoder gets the payload (a view) and the limits and
raises :class:`ProtocolError` (a session error) and nothing else."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raven.protocol.frames.base import (
    BATCHED_HEADER,
    DEFAULT_LIMITS,
    HEADER_SIZE,
    MAX_REFUSAL_REASON,
    MAX_RELEASE,
    MAX_ROUTES,
    MAX_SESSION_ID,
    SUPPORTED_VERSIONS,
    U64,
    FrameType,
    Limits,
    ProtocolError,
    header,
    peer_text,
    valid_node_name,
    valid_session_id,
)
from raven.protocol.frames.streams import RESET_FIXED

_RELEASE = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]*\Z")  # a PEP 440 / semver-like string, e.g. 0.2.0 or 1.0.0rc1


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _load_json(payload: memoryview, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(payload))
    except (ValueError, RecursionError):
        raise ProtocolError(f"{what} is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} is not a JSON object")
    return obj


def _field(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, typ) or isinstance(value, bool):
        raise ProtocolError(f"{what}: field {key!r} missing or of the wrong type")
    return value


def _positive(value: int | float, key: str, what: str, upper: float = 2**31 - 1) -> None:
    if not 0 < value <= upper:
        raise ProtocolError(f"{what}: field {key!r} out of range")


def _str_list(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"{what} must be a list of strings")
    return value


def _release_field(release: str) -> dict[str, str]:
    """HELLO's and WELCOME's optional ``release``: sent only when set, so that an unset one encodes as before.
    Releases before 0.2.0 ignore the key (their decoders read the keys they know and no others)."""
    if not release:
        return {}
    if len(release) > MAX_RELEASE or not _RELEASE.match(release):
        raise ValueError(f"release {release[:80]!r} is not a version string of at most {MAX_RELEASE} characters")
    return {"release": release}


def _read_release(obj: dict[str, Any], what: str) -> str:
    release = obj.get("release", "")
    if release == "":
        return ""
    if not isinstance(release, str) or len(release) > MAX_RELEASE or not _RELEASE.match(release):
        raise ProtocolError(f"{what}: field 'release' must be a version string of at most {MAX_RELEASE} characters")
    return release


# ---------------------------------------------------------------- HELLO


@dataclass(frozen=True, slots=True)
class Hello:
    """Agent -> gateway, first frame of a session."""

    agent: str
    session: str
    versions: tuple[int, ...] = SUPPORTED_VERSIONS
    window: int = 256 * 1024  # initial per-stream receive window the agent grants
    max_streams: int = 1024  # streams the agent accepts at once
    release: str = ""  # the agent's software release (from 0.2.0 on; empty: not announced, 0.1.0 or older)


def encode_hello(frame: Hello) -> bytes:
    return header(FrameType.HELLO, 0, 0) + _json(
        {
            "agent": frame.agent,
            "session": frame.session,
            "versions": list(frame.versions),
            "window": frame.window,
            "max_streams": frame.max_streams,
            **_release_field(frame.release),
        }
    )


def decode_hello(payload: memoryview, limits: Limits) -> Hello:
    obj = _load_json(payload, "HELLO")
    versions = obj.get("versions")
    if (
        not isinstance(versions, list)
        or not versions
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in versions)
    ):
        raise ProtocolError("HELLO: field 'versions' must be a non-empty list of integers")
    window = _field(obj, "window", int, "HELLO")
    max_streams = _field(obj, "max_streams", int, "HELLO")
    _positive(window, "window", "HELLO")
    _positive(max_streams, "max_streams", "HELLO", 1 << 20)
    # Both are kept for the session's life and shown (logs, `raven status`, the status page): checked here, where
    # they enter, so that nothing downstream holds a name or an id of the peer's own shape.
    agent = _field(obj, "agent", str, "HELLO")
    if not valid_node_name(agent):
        raise ProtocolError("HELLO: field 'agent' must be an RFC 1123 name (lower-case letters, digits, '-' and "
                            "'.', at most 253 characters)")
    session = _field(obj, "session", str, "HELLO")
    if not valid_session_id(session):
        raise ProtocolError(f"HELLO: field 'session' must be 1..{MAX_SESSION_ID} characters of [A-Za-z0-9_-]")
    return Hello(
        agent=agent,
        session=session,
        versions=tuple(versions),
        window=window,
        max_streams=max_streams,
        release=_read_release(obj, "HELLO"),
    )


# ---------------------------------------------------------------- WELCOME


@dataclass(frozen=True, slots=True)
class Welcome:
    """Gateway -> agent, answer to HELLO."""

    version: int
    replica: str
    replicas: int
    heartbeat_interval: float
    heartbeat_timeout: float
    window: int = 256 * 1024
    max_streams: int = 1024
    release: str = ""  # the gateway's software release (from 0.2.0 on; empty: not announced)


def encode_welcome(frame: Welcome) -> bytes:
    return header(FrameType.WELCOME, 0, 0) + _json(
        {
            "version": frame.version,
            "replica": frame.replica,
            "replicas": frame.replicas,
            "heartbeat_interval": frame.heartbeat_interval,
            "heartbeat_timeout": frame.heartbeat_timeout,
            "window": frame.window,
            "max_streams": frame.max_streams,
            **_release_field(frame.release),
        }
    )


def decode_welcome(payload: memoryview, limits: Limits) -> Welcome:
    obj = _load_json(payload, "WELCOME")
    interval = _field(obj, "heartbeat_interval", (int, float), "WELCOME")
    timeout = _field(obj, "heartbeat_timeout", (int, float), "WELCOME")
    _positive(interval, "heartbeat_interval", "WELCOME", 3600)
    _positive(timeout, "heartbeat_timeout", "WELCOME", 3600)
    replicas = _field(obj, "replicas", int, "WELCOME")
    _positive(replicas, "replicas", "WELCOME", 1 << 16)
    window = _field(obj, "window", int, "WELCOME")
    max_streams = _field(obj, "max_streams", int, "WELCOME")
    _positive(window, "window", "WELCOME")
    _positive(max_streams, "max_streams", "WELCOME", 1 << 20)
    return Welcome(
        version=_field(obj, "version", int, "WELCOME"),
        replica=_field(obj, "replica", str, "WELCOME"),
        replicas=replicas,
        heartbeat_interval=float(interval),
        heartbeat_timeout=float(timeout),
        window=window,
        max_streams=max_streams,
        release=_read_release(obj, "WELCOME"),
    )


# ---------------------------------------------------------------- REGISTER


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    address: str
    pool: str


@dataclass(frozen=True, slots=True)
class Register:
    """Agent -> gateway: the complete set of nodes this session fronts (replaces earlier sets)."""

    nodes: tuple[NodeInfo, ...]


def encode_register(frame: Register) -> bytes:
    return header(FrameType.REGISTER, 0, 0) + _json({"nodes": [[n.name, n.address, n.pool] for n in frame.nodes]})


def decode_register(payload: memoryview, limits: Limits) -> Register:
    obj = _load_json(payload, "REGISTER")
    nodes = obj.get("nodes")
    if not isinstance(nodes, list):
        raise ProtocolError("REGISTER: field 'nodes' must be a list")
    out = []
    # Nodes of one registration mostly share their pool (and often an address): one string object each,
    # not one per node, since the gateway keeps the registration for the session's life.
    same: dict[str, str] = {}
    for entry in nodes:
        items = _str_list(entry, "REGISTER: each node")
        if len(items) != 3:
            raise ProtocolError("REGISTER: each node must be [name, address, pool]")
        name, address, pool = items
        out.append(NodeInfo(name, same.setdefault(address, address), same.setdefault(pool, pool)))
    return Register(tuple(out))


# ---------------------------------------------------------------- REGISTERED


@dataclass(frozen=True, slots=True)
class Registered:
    """Gateway -> agent: which nodes were accepted and which refused, with reasons."""

    accepted: tuple[str, ...]
    refused: tuple[tuple[str, str], ...]


def encode_registered(frame: Registered) -> bytes:
    return header(FrameType.REGISTERED, 0, 0) + _json(
        {"accepted": list(frame.accepted), "refused": [list(r) for r in frame.refused]}
    )


def decode_registered(payload: memoryview, limits: Limits) -> Registered:
    obj = _load_json(payload, "REGISTERED")
    accepted = _str_list(obj.get("accepted"), "REGISTERED: 'accepted'")
    refused_raw = obj.get("refused")
    if not isinstance(refused_raw, list):
        raise ProtocolError("REGISTERED: field 'refused' must be a list")
    refused = []
    for entry in refused_raw:
        items = _str_list(entry, "REGISTERED: each refusal")
        if len(items) != 2:
            raise ProtocolError("REGISTERED: each refusal must be [name, reason]")
        refused.append((items[0], items[1]))
    return Registered(tuple(accepted), tuple(refused))


def split_registered(
    accepted: Sequence[str], refused: Sequence[tuple[str, str]], budget: int = 128 * 1024
) -> list[Registered]:
    """One registration's answer as REGISTERED frames of at most ``budget`` bytes each.

    Every agent accepts frames of 256 KiB at least (``max_frame`` has that floor), so the default budget
    fits any agent. Refusal reasons are cut to ``MAX_REFUSAL_REASON`` characters. The agent adds the
    frames up (each carries part of the answer). Refused names are cut to 253 characters.
    """
    out: list[Registered] = []
    acc: list[str] = []
    ref: list[tuple[str, str]] = []
    size = 64  # the frame header and the JSON skeleton
    items: list[tuple[str, str | tuple[str, str]]] = [("a", name) for name in accepted]
    # A refused name is echoed cut to 253 characters (a valid name never is): a peer's 1 MiB name must not
    # come back as a frame larger than any agent accepts.
    items += [("r", (name[:253], reason[:MAX_REFUSAL_REASON])) for name, reason in refused]
    for kind, item in items:
        cost = len(json.dumps(item)) + 2
        if (acc or ref) and size + cost > budget:
            out.append(Registered(tuple(acc), tuple(ref)))
            acc, ref, size = [], [], 64
        if kind == "a":
            acc.append(item)  # type: ignore[arg-type]
        else:
            ref.append(item)  # type: ignore[arg-type]
        size += cost
    if acc or ref or not out:
        out.append(Registered(tuple(acc), tuple(ref)))
    return out


# ---------------------------------------------------------------- PING and PONG


@dataclass(frozen=True, slots=True)
class Ping:
    opaque: int


@dataclass(frozen=True, slots=True)
class Pong:
    opaque: int


def encode_ping(frame: Ping) -> bytes:
    return header(FrameType.PING, 0, 0) + U64.pack(frame.opaque)


def encode_pong(frame: Pong) -> bytes:
    return header(FrameType.PONG, 0, 0) + U64.pack(frame.opaque)


def _opaque(payload: memoryview, what: str) -> int:
    if len(payload) != 8:
        raise ProtocolError(f"{what} payload must be 8 bytes, got {len(payload)}")
    return int(U64.unpack(payload)[0])


def decode_ping(payload: memoryview, limits: Limits) -> Ping:
    return Ping(_opaque(payload, "PING"))


def decode_pong(payload: memoryview, limits: Limits) -> Pong:
    return Pong(_opaque(payload, "PONG"))


# ---------------------------------------------------------------- DRAIN and GOAWAY


@dataclass(frozen=True, slots=True)
class Drain:
    reason: str = ""


def encode_drain(frame: Drain) -> bytes:
    return header(FrameType.DRAIN, 0, 0) + frame.reason.encode("utf-8")[: DEFAULT_LIMITS.max_reason]


def decode_drain(payload: memoryview, limits: Limits) -> Drain:
    if len(payload) > limits.max_reason:
        raise ProtocolError("DRAIN reason too long")
    return Drain(peer_text(payload, limits.max_reason))


@dataclass(frozen=True, slots=True)
class GoAway:
    code: int
    reason: str


def encode_goaway(frame: GoAway) -> bytes:
    reason = frame.reason.encode("utf-8")[: DEFAULT_LIMITS.max_reason]
    return header(FrameType.GOAWAY, 0, 0) + RESET_FIXED.pack(frame.code) + reason


def decode_goaway(payload: memoryview, limits: Limits) -> GoAway:
    if not 2 <= len(payload) <= 2 + limits.max_reason:
        raise ProtocolError("GOAWAY payload has a bad length")
    return GoAway(int(RESET_FIXED.unpack(payload[:2])[0]), peer_text(payload[2:], limits.max_reason))


# ---------------------------------------------------------------- layer 3: DATAGRAM and ROUTES


@dataclass(frozen=True, slots=True)
class Datagram:
    """One IP packet (layer 3); dropped, never queued without bound, when the session is congested."""

    packet: bytes | memoryview = field(repr=False)


def encode_datagram(frame: Datagram) -> bytes:
    return header(FrameType.DATAGRAM, 0, 0) + frame.packet


def datagram_header(length: int) -> bytes:
    """Length prefix and frame header of a DATAGRAM of ``length`` bytes (version 2)."""
    return BATCHED_HEADER.pack(HEADER_SIZE + length, FrameType.DATAGRAM, 0, 0)


def decode_datagram(payload: memoryview, limits: Limits) -> Datagram:
    if not 0 < len(payload) <= limits.max_data:
        raise ProtocolError(f"DATAGRAM of {len(payload)} bytes: must be 1..{limits.max_data}")
    return Datagram(payload)


@dataclass(frozen=True, slots=True)
class Routes:
    """Layer 3. Agent -> gateway: the CIDRs this agent announces for its pool (empty: it carries no layer 3).
    Gateway -> agent: the CIDRs reachable through this session, and whether this agent is its pool's active one
    (the one the gateway sends the pool's packets to)."""

    cidrs: tuple[str, ...]
    active: bool = False
    pool: str = ""  # agent -> gateway: the pool the CIDRs belong to (one of its certificate's)


def encode_routes(frame: Routes) -> bytes:
    return header(FrameType.ROUTES, 0, 0) + _json({"cidrs": list(frame.cidrs), "active": frame.active,
                                                     "pool": frame.pool})


def decode_routes(payload: memoryview, limits: Limits) -> Routes:
    obj = _load_json(payload, "ROUTES")
    cidrs = _str_list(obj.get("cidrs"), "ROUTES: 'cidrs'")
    if len(cidrs) > MAX_ROUTES or any(len(c) > 64 for c in cidrs):
        raise ProtocolError(f"ROUTES: at most {MAX_ROUTES} CIDRs of at most 64 characters")
    active = obj.get("active", False)
    pool = obj.get("pool", "")
    if not isinstance(active, bool) or not isinstance(pool, str) or len(pool) > 63:
        raise ProtocolError("ROUTES: 'active' must be a boolean and 'pool' a name")
    return Routes(tuple(cidrs), active, pool)


ControlFrame = Hello | Welcome | Register | Registered | Ping | Pong | Drain | GoAway | Datagram | Routes
