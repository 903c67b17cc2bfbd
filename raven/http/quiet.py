"""Whether an idle keep-alive connection is quiet: nothing of a next request has arrived, so a close loses nothing.

The connection guard (raven/http/guard.py) closes an idle connection at its keep-alive deadline and when
the service drains. A close is safe only while nothing of the client's next request has arrived:

- bytes in the socket that the event loop has not read yet turn the close into a TCP reset (the kernel resets
  a socket closed with unread data), and the client gets no byte of an answer: :func:`unread_bytes`;
- a request aiohttp read while it answered the last one (the client sent it as that answer's end reached it,
  or pipelined) is lost with the connection, and so is an answer aiohttp is still sending: :func:`parked`.

What no server can see is a request still on the wire as the close leaves: the server's kernel answers its
bytes with a reset. HTTP clients send an idempotent request that got no byte back again on a new connection
(RFC 9112 section 9.3.1; Go's client, so Prometheus, does).
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios

__all__ = ["parked", "unread_bytes"]


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this connection that the event loop has not read yet (0 when it cannot tell).

    With TLS these are records not decrypted yet: any of them (a request, or the client's close_notify) means
    the connection is not quiet.
    """
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        count: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError):  # closed meanwhile
        return 0
    return count


def parked(protocol: asyncio.BaseProtocol) -> bool:
    """Whether aiohttp's server protocol waits for its next request, holding none.

    aiohttp's request loop (``web_protocol.RequestHandler.start``) parks on ``_waiter`` only with no parsed
    request queued; while it still sends the last answer, or holds a request read meanwhile, there is no such
    waiter or it is done. aiohttp's own keep-alive timer closes a connection only in this state
    (``RequestHandler._process_keepalive``); tests/integration/test_listener_drain.py holds it to that. A
    protocol without that loop is taken as parked: the guard's phase alone tells. The lean server's protocol
    (raven/http/h1server.py) says it itself (``quiet()``).
    """
    quiet = getattr(protocol, "quiet", None)
    if quiet is not None:
        return bool(quiet())
    if not hasattr(protocol, "_waiter"):
        return True
    waiter: asyncio.Future[None] | None = protocol._waiter
    return waiter is not None and not waiter.done()
