"""A request's terms across protocol versions: the deadline, the client (fairness) key and the hints the gateway
states with each OPEN.

From version 3 (``wire.FIELDS_FROM``) they are OPEN's fields (:class:`~raven.protocol.wire.OpenFields`, flag
FIELDS) and ``x-raven-*`` headers mean nothing; before it they travel as the ``x-raven-*`` headers of
raven/protocol/headers.py. The session's version decides: :func:`as_sent` writes an OPEN for a session of a
given version, :func:`check_version` rejects an OPEN written for another version, and :func:`terms_of` reads the
terms of a received one, whichever way they came. Pure functions, no I/O.
"""

from __future__ import annotations

import re

from raven.protocol import wire
from raven.protocol.headers import CLIENT_HEADER, COMPRESS_HEADER, DEADLINE_HEADER, RAVEN_PREFIX

_CLIENT_KEY = re.compile(rf"[A-Za-z0-9_-]{{1,{wire.MAX_CLIENT_KEY}}}")
_MAX_DEADLINE_DIGITS = 9  # a longer header value is ignored (versions 1 and 2 read it so)


def clamp_deadline_ms(ms: int) -> int:
    """A deadline as the contract carries it: whole milliseconds, 1..``wire.MAX_DEADLINE_MS`` (the one clamp, for
    what is sent and for a header read leniently; raven/deadline.py makes and spends the value)."""
    return min(max(1, ms), wire.MAX_DEADLINE_MS)


def legacy_headers(fields: wire.OpenFields) -> wire.Headers:
    """The ``x-raven-*`` headers that state ``fields`` to a peer of version 1 or 2 (nothing for what is unset)."""
    out: list[tuple[str, str]] = []
    if fields.deadline_ms:
        out.append((DEADLINE_HEADER, str(fields.deadline_ms)))
    if fields.client:
        out.append((CLIENT_HEADER, fields.client))
    if fields.uplink_free:
        out.append((COMPRESS_HEADER, "0"))
    return tuple(out)


def as_sent(frame: wire.Open, stream_id: int, version: int) -> wire.Open:
    """``frame`` as a session of ``version`` sends it on ``stream_id``: its terms (none: all unset) as fields
    from version 3, as ``x-raven-*`` headers after its own before it."""
    fields = frame.fields if frame.fields is not None else wire.OpenFields()
    # Built field by field, not with dataclasses.replace: this runs once per request, and replace() inspects the
    # class's fields each time (several times the cost).
    if version >= wire.FIELDS_FROM:
        return wire.Open(stream_id, frame.kind, frame.node, frame.port, frame.method, frame.target, frame.headers,
                         frame.fin, fields)
    return wire.Open(stream_id, frame.kind, frame.node, frame.port, frame.method, frame.target,
                     (*frame.headers, *legacy_headers(fields)), frame.fin, None)


def check_version(frame: wire.Open, version: int) -> None:
    """Raise :class:`~raven.protocol.wire.ProtocolError` (for the stream) unless ``frame`` carries its terms the
    way ``version`` says: as fields from version 3, never as fields before it."""
    if (frame.fields is not None) != (version >= wire.FIELDS_FROM):
        has = "with" if frame.fields is not None else "without"
        raise wire.ProtocolError(f"OPEN {has} fields on a version {version} session", frame.stream_id)


def terms_of(frame: wire.Open) -> wire.OpenFields:
    """The terms of a received OPEN: its fields (version 3 on), else its ``x-raven-*`` headers read leniently, a
    malformed value counting as unset. The wire's bounds hold either way; the agent applies its own on top."""
    if frame.fields is not None:
        return frame.fields
    deadline_ms, client, uplink_free = 0, "", False
    for name, value in frame.headers:
        low = name.lower()
        if not low.startswith(RAVEN_PREFIX):
            continue
        if low == DEADLINE_HEADER:
            if value.isascii() and value.isdigit() and len(value) <= _MAX_DEADLINE_DIGITS:
                deadline_ms = clamp_deadline_ms(int(value))
        elif low == CLIENT_HEADER:
            if _CLIENT_KEY.fullmatch(value):
                client = value
        elif low == COMPRESS_HEADER and value.strip() == "0":
            uplink_free = True
    return wire.OpenFields(deadline_ms, client, uplink_free)
