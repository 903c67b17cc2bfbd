"""Who broke the protocol, as h11 says it: :class:`LocalProtocolError` (this side asked for something the protocol
does not allow: a bug in the caller) and :class:`RemoteProtocolError` (the peer's messages cannot start or go on
with a connection), and the core's own codes for a handshake that fails (:class:`HandshakeCode`).

The core knows no HTTP status and no metric label: the services map a code to those (raven/refusals.py).
"""

from __future__ import annotations

import enum

from mypy_extensions import mypyc_attr

from raven.errors import RavenError


class HandshakeCode(enum.Enum):
    """Why HELLO/WELCOME did not open a connection (the peer's doing)."""

    # The gateway reading HELLO:
    NO_HELLO = "no-hello"  # none in time, or the first frame is another
    BAD_HELLO = "bad-hello"  # the first message does not decode, or is not binary
    VERSION = "version"  # no protocol version both sides speak
    # The agent reading the answer:
    GOAWAY = "goaway"  # the gateway refused (its reason is in the text)
    BAD_WELCOME = "bad-welcome"  # the answer does not decode
    UNEXPECTED_FRAME = "unexpected-frame"  # the answer is neither WELCOME nor GOAWAY
    WELCOME_VERSION = "welcome-version"  # the gateway chose a version this agent does not speak
    CLOSED = "closed"  # the connection closed before the answer


@mypyc_attr(native_class=False)  # two exception bases: an ordinary class when compiled
class LocalProtocolError(RavenError, RuntimeError):
    """This side tried something the protocol does not allow (a bug in the caller, never the peer's doing)."""


class RemoteProtocolError(RavenError):
    """The peer's messages cannot open a connection: ``code`` says why (what code reads), ``text`` says it for
    people (logged; the gateway sends it in GOAWAY)."""

    def __init__(self, code: HandshakeCode, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text

    def __repr__(self) -> str:
        return f"RemoteProtocolError({self.code.name}, {self.text!r})"
