"""What a backfill stream carries: the scrapes an agent kept through an outage, as entries. Sans-I/O, no clock.

The gateway opens a stream of kind BACKFILL (``wire.StreamKind.BACKFILL``, node "", port 0) whose target is
:func:`ack_target` of the last sequence number it has written to every receiver (0: none). The agent drops what
that acknowledges, answers HEAD 200 with its backlog's size (:data:`BACKLOG_HEADERS`) and one batch of entries
as the body, or HEAD 204 when it holds nothing. Entries are length-prefixed:

    type u8, length u32, payload

- KEY (1): ``key u64, node u8+utf-8, blob``: a page of the node, zstd-compressed on its own. Later scrapes of the
  node are compressed with that page as their dictionary (consecutive pages differ mostly in values). ``key`` is
  the sequence number of the scrape that made it.
- SCRAPE (2): ``seq u64, ts_ms u64, key u64, port u16, node u8+utf-8, blob``: one page, zstd with the key's
  page as a raw-content dictionary (empty: the page is the key's own); ``ts_ms`` when the agent began the scrape
  (Unix milliseconds).

A stream sends the KEY of a scrape before the scrape. The pages themselves are not touched here: what the blob
holds is raven/backfill/pages.py's. :class:`Decoder` is fed the body as it comes and refuses oversized or
malformed entries with :class:`BackfillError` (the caller drops the batch and counts it).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Final

from raven.errors import RavenError

KEY: Final = 1
SCRAPE: Final = 2
MAX_ENTRY: Final = 16 * 1024 * 1024  # one entry's payload (a compressed page): the decoder's default bound
BACKLOG_HEADERS: Final = ("backlog-bytes", "backlog-scrapes", "backlog-oldest-ms")

_PREFIX = struct.Struct("!BI")
_KEY = struct.Struct("!Q")
_SCRAPE = struct.Struct("!QQQH")


class BackfillError(RavenError):
    """A backfill body that does not decode: the batch is dropped (and counted), the session lives on."""


@dataclass(frozen=True, slots=True)
class Key:
    key: int
    node: str
    blob: bytes


@dataclass(frozen=True, slots=True)
class Scrape:
    seq: int
    ts_ms: int
    key: int
    port: int
    node: str
    blob: bytes


Entry = Key | Scrape


def ack_target(ack: int) -> str:
    """The OPEN target that acknowledges every scrape up to ``ack``."""
    return f"/backfill?ack={ack}"


_TARGET = re.compile(r"/backfill\?ack=([0-9]{1,20})")


def parse_ack(target: str) -> int:
    """The acknowledged sequence number of a backfill OPEN's target; raise :class:`BackfillError`."""
    m = _TARGET.fullmatch(target)
    if m is None or int(m.group(1)) >= 2**64:
        raise BackfillError(f"backfill target {target[:60]!r} is not /backfill?ack=N")
    return int(m.group(1))


def _node(node: str) -> bytes:
    raw = node.encode("utf-8")
    if not 0 < len(raw) <= 253:
        raise ValueError(f"node name of {len(raw)} bytes")
    return bytes((len(raw),)) + raw


def encode(entry: Entry) -> bytes:
    if isinstance(entry, Key):
        payload = _KEY.pack(entry.key) + _node(entry.node) + entry.blob
        kind = KEY
    else:
        payload = _SCRAPE.pack(entry.seq, entry.ts_ms, entry.key, entry.port) + _node(entry.node) + entry.blob
        kind = SCRAPE
    return _PREFIX.pack(kind, len(payload)) + payload


def _split_node(payload: memoryview, at: int) -> tuple[str, int]:
    if at >= len(payload):
        raise BackfillError("entry ends before its node name")
    n = payload[at]
    if n == 0 or at + 1 + n > len(payload):
        raise BackfillError(f"node name of {n} bytes does not fit its entry")
    try:
        return bytes(payload[at + 1:at + 1 + n]).decode("utf-8"), at + 1 + n
    except UnicodeDecodeError:
        raise BackfillError("node name is not UTF-8") from None


def decode_entry(kind: int, payload: memoryview) -> Entry:
    if kind == KEY:
        if len(payload) < _KEY.size:
            raise BackfillError("KEY entry too short")
        (key,) = _KEY.unpack_from(payload)
        node, at = _split_node(payload, _KEY.size)
        return Key(key, node, bytes(payload[at:]))
    if kind == SCRAPE:
        if len(payload) < _SCRAPE.size:
            raise BackfillError("SCRAPE entry too short")
        seq, ts_ms, key, port = _SCRAPE.unpack_from(payload)
        node, at = _split_node(payload, _SCRAPE.size)
        return Scrape(seq, ts_ms, key, port, node, bytes(payload[at:]))
    raise BackfillError(f"unknown backfill entry type {kind}")


class Decoder:
    """Entries out of a body fed in pieces; at most ``max_entry`` bytes per entry, ``max_body`` in all."""

    def __init__(self, max_entry: int = MAX_ENTRY, max_body: int = 64 * MAX_ENTRY) -> None:
        self.max_entry = max_entry
        self.max_body = max_body
        self.received = 0
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> list[Entry]:
        self.received += len(data)
        if self.received > self.max_body:
            raise BackfillError(f"backfill body over {self.max_body} bytes")
        self._buf += data
        out: list[Entry] = []
        at = 0
        view = memoryview(self._buf)
        try:
            while len(view) - at >= _PREFIX.size:
                kind, length = _PREFIX.unpack_from(view, at)
                if length > self.max_entry:
                    raise BackfillError(f"backfill entry of {length} bytes, limit {self.max_entry}")
                if len(view) - at - _PREFIX.size < length:
                    break
                start = at + _PREFIX.size
                out.append(decode_entry(kind, view[start:start + length]))
                at = start + length
        finally:
            view.release()
        del self._buf[:at]
        return out

    def finish(self) -> None:
        """The body ended: raise if it ended inside an entry."""
        if self._buf:
            raise BackfillError(f"backfill body ends inside an entry ({len(self._buf)} bytes left)")
