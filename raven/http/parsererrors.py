"""What aiohttp writes about requests it could not handle: one line, no raw bytes, rate-limited per client.

aiohttp's server logs every request its parser rejects ("Error handling request from ADDRESS") with the
exception, whose text quotes the raw bytes of the request, credentials included, as a traceback. Any client
that can reach a port can cause such a line as often as it likes. :class:`ParserErrorLines`, put on the
server's logger by :func:`install`, turns each into one WARNING line that names the client and the parser's
reason (without the quoted bytes), and lets at most one such line per client a minute through, with a count
of those it held back. Any other exception aiohttp reports (a bug in a handler) keeps its traceback, rate-limited
the same way. What is left is still redacted and escaped by raven/logsafe.py on the handler.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

from raven.lograte import RateLimitedLog

_BYTES_QUOTE = ("b'", 'b"')


def parser_reason(exc: BaseException) -> str:
    """The parser's words for what was wrong, without the request bytes it quotes after them."""
    text = getattr(exc, "message", None)
    if not isinstance(text, str) or not text:
        text = str(exc)
    words: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            if words:
                break  # aiohttp puts the quoted bytes after a blank line
            continue
        if stripped.startswith(_BYTES_QUOTE) or set(stripped) <= {"^", "~", " "}:
            break
        words.append(stripped)
    reason = " ".join(words).rstrip(":") or type(exc).__name__
    return f"{type(exc).__name__}: {reason[:200]}"


class ParserErrorLines(logging.Filter):
    """A logger filter: one short, rate-limited line per client for each request aiohttp could not handle."""

    def __init__(self, interval: float = 60.0) -> None:
        super().__init__()
        self._limit = RateLimitedLog(logging.getLogger("raven.http"), interval=interval)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        peer = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "?"
        parser = isinstance(exc, HttpProcessingError)
        suppressed = self._limit.allow(peer, "malformed" if parser else "handler-error")
        if suppressed is None:
            return False
        if not parser:  # a bug of Raven's: keep the traceback (SafeLines redacts and escapes it), say the count
            record.msg = f"{record.getMessage()}{self._limit.suffix(peer, suppressed)}"
            record.args = ()
            return True
        record.msg = "request from %s not handled: %s%s"
        record.args = (peer, parser_reason(exc), self._limit.suffix(peer, suppressed))
        record.exc_info = None
        record.exc_text = None
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def install(*names: str) -> logging.Logger:
    """Put :class:`ParserErrorLines` on the named loggers (aiohttp's own server logger always); returns the
    last one, to hand to ``web.Server(logger=...)``."""
    logger = logging.getLogger("aiohttp.server")
    for name in ("aiohttp.server", *names):
        logger = logging.getLogger(name)
        if not any(isinstance(f, ParserErrorLines) for f in logger.filters):
            logger.addFilter(ParserErrorLines())
    return logger


class MalformedLines:
    """The same line for the lean server (raven/http/h1server.py), which reports a refused request itself:
    ``request from CLIENT not handled: REASON``, at most one per client a minute."""

    def __init__(self, interval: float = 60.0) -> None:
        self._log = logging.getLogger("raven.http")
        self._limit = RateLimitedLog(self._log, interval=interval)

    def __call__(self, client: str, reason: str) -> None:
        suppressed = self._limit.allow(client, "malformed")
        if suppressed is not None:
            self._log.warning("request from %s not handled: %s%s", client, reason[:200],
                              self._limit.suffix(client, suppressed))
