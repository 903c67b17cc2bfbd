"""The tunnel protocol's sans-I/O core: no asyncio, no aiohttp; bytes in, events out, ``data_to_send()`` out.

- ``wire``: the codec (frames, batched messages from version 2, strict and bounded decoding); each frame's
  encoder and decoder are in ``frames``;
- ``connection``: one connection's state machine from HELLO to CLOSED (stream table and ids, heartbeat deadlines
  driven by a ``now`` passed in); ``handshake``: each side's half of HELLO/WELCOME on it (``ClientConnection``,
  ``ServerConnection``); ``errors``: the local/remote error pair and the handshake's codes;
- ``state``: the connection's life as named states and the table of their transitions;
- ``stream``: one stream's halves as a transition table, its flow accounts and errors;
- ``outbox``: what a session has to send, batched into messages (frames first, then layer-3 packets);
- ``events``: what ``connection`` reports;
- ``control``: one dispatcher for control frames (a table by frame type);
- ``flow``: per-stream credit accounting (windows);
- ``headers``: the HTTP side of the contract (which headers cross the tunnel, which are Raven's own, the one
  filter both ends apply, the one set of idempotent methods);
- ``terms``: a request's terms (deadline, client key, hints) as OPEN's fields from version 3, as ``x-raven-*``
  headers before it.

raven/transport/ runs a session over an asyncio WebSocket. See docs/protocol.md.

The names the services need for the HTTP-over-tunnel contract are re-exported here: ``from raven.protocol import
Open, OpenFields, filter_headers, terms_of``.
"""

from raven.protocol.headers import FORWARDED, FRAMING, HOP_BY_HOP, IDEMPOTENT, RAVEN_PREFIX, filter_headers
from raven.protocol.terms import as_sent, check_version, legacy_headers, terms_of
from raven.protocol.wire import (
    DEFAULT_LIMITS,
    FIELDS_FROM,
    MAX_CLIENT_KEY,
    MAX_DEADLINE_MS,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Head,
    Headers,
    Limits,
    Open,
    OpenFields,
    ProtocolError,
    ResetCode,
    StreamKind,
)

__all__ = [
    "DEFAULT_LIMITS", "FIELDS_FROM", "FORWARDED", "FRAMING", "HOP_BY_HOP", "IDEMPOTENT", "MAX_CLIENT_KEY",
    "MAX_DEADLINE_MS", "PROTOCOL_VERSION", "RAVEN_PREFIX", "SUPPORTED_VERSIONS", "Head", "Headers", "Limits", "Open",
    "OpenFields", "ProtocolError", "ResetCode", "StreamKind", "as_sent", "check_version", "filter_headers",
    "legacy_headers", "terms_of",
]
