"""What may reach a log line: secrets redacted, control characters escaped, length bounded.

Peers and clients choose much of what Raven logs: node names, request targets, header values, the reasons
carried by GOAWAY and DRAIN, the raw bytes of a request the HTTP parser rejected. :func:`clean` makes such
text safe to write: credentials (``Authorization``, ``Proxy-Authorization``, ``Cookie`` fields, ``Bearer`` and
``Basic`` values, a URL's user info, query strings, and every secret registered with :func:`add_secrets`) are
replaced by ``<redacted>``; control characters (newlines, NUL, terminal escapes, Unicode line separators and
bidirectional overrides) are escaped as ``\\n``, ``\\x00``, ``\\x1b``..., so that one record is one line and
no peer can forge another line or drive a terminal; and the line is cut at ``MAX_LINE`` characters.

:class:`SafeLines` applies :func:`clean` to every record a handler writes, whoever logged it (Raven or its
libraries), including the text of an exception's traceback; :func:`install` puts it on the root logger's
handlers. Raven's own log calls need no escaping of their own: this is the one place it happens.

:func:`escape` is also the one rule for control characters wherever else Raven shows what a peer chose: the wire
decoder applies it to the free-text reasons peers send (RESET, GOAWAY, DRAIN: ``peer_text`` in
raven/protocol/frames/base.py), and ``raven status`` and the status page apply it to every cell they show
(gateway/status.py), whatever the snapshot holds.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable

MAX_LINE = 2000  # characters of one log message, after interpolation
REDACTED = "<redacted>"

# A credential-bearing field as it appears in a header block, a repr of raw bytes or a dict: name, separator,
# then the value up to the end of the field (a line end, a quote, or the backslash of an escaped \r\n).
_SECRET_FIELD = re.compile(
    r"(?i)\b((?:proxy-)?authorization|cookie|set-cookie|x-api-key|x-auth-token|private-token)"
    r"(['\"]?\s*[:=]\s*['\"]?)[^\r\n'\"\\)]+"
)
# An HTTP authentication scheme followed by its credentials, wherever it appears: a token-like word (at least
# 8 characters, not a plain lower-case word such as "bearer tokens" or "basic authentication").
_SCHEME = re.compile(r"\b(Bearer|Basic|bearer|basic|BEARER|BASIC)(\s+)([A-Za-z0-9\-._~+/]{8,}=*)")
# The user info of a URL (http://user:password@host).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/\s@'\"\\]*@")
# A query string after a path or URL: everything up to white space, a quote, a fragment or an escape.
_QUERY = re.compile(r"(?<=[^\s?'\"])\?[^\s'\"\\#]+")
# Control characters and the Unicode ones that end a line or reorder text on a terminal.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

_secret_sources: list[Callable[[], Iterable[bytes]]] = []
_sources_lock = threading.Lock()


def add_secrets(source: Callable[[], Iterable[bytes]]) -> None:
    """Register secrets (e.g. the front end's tokens) that are redacted wherever they appear in a log line."""
    with _sources_lock:
        _secret_sources.append(source)


def remove_secrets(source: Callable[[], Iterable[bytes]]) -> None:
    with _sources_lock:
        if source in _secret_sources:
            _secret_sources.remove(source)


def _escape_char(match: re.Match[str]) -> str:
    c = match.group()
    named = _NAMED.get(c)
    if named is not None:
        return named
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def escape(text: str) -> str:
    """Control characters as visible escapes: the text stays on one line and cannot drive a terminal."""
    return _CONTROL.sub(_escape_char, text)


def _scheme_value(match: re.Match[str]) -> str:
    value = match.group(3)
    if value.isalpha() and value.islower():
        return match.group()  # a word of prose, not a credential
    return f"{match.group(1)}{match.group(2)}{REDACTED}"


def redact(text: str) -> str:
    """Credentials, cookies, URL user info, query strings and registered secrets replaced by <redacted>."""
    for source in list(_secret_sources):
        try:
            secrets = list(source())
        except Exception:  # a failing source must not lose the log line
            continue
        for secret in secrets:
            value = secret.decode("latin-1") if isinstance(secret, bytes) else str(secret)
            if value and value in text:
                text = text.replace(value, REDACTED)
    text = _SECRET_FIELD.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _SCHEME.sub(_scheme_value, text)
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    return _QUERY.sub("?" + REDACTED, text)


def clean(text: str, limit: int = MAX_LINE) -> str:
    """Everything a log line needs: redacted, escaped, and at most ``limit`` characters (then says how many
    were cut)."""
    text = escape(redact(text))
    if len(text) > limit:
        text = text[:limit] + f"... [{len(text) - limit} characters cut]"
    return text


def path_for_log(target: str, limit: int = 200) -> str:
    """A request target for a log line: the path without its query (which may carry a credential)."""
    path, sep, _ = target.partition("?")
    return path[:limit] + (f"?{REDACTED}" if sep else "")


class SafeLines(logging.Filter):
    """On a handler: every record it writes is :func:`clean` (message) and its traceback, if any, is redacted,
    escaped line by line and indented, so that no continuation line can pose as a record of its own."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "raven_clean", False):
            return True  # already done for another handler
        try:
            text = record.getMessage()
        except Exception:  # a bad format string must not lose the record
            text = f"{record.msg!r} % {record.args!r}"
        record.msg = clean(text, self.limit)
        record.args = ()
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            lines = redact(record.exc_text).splitlines()
            record.exc_text = "\n".join("  " + escape(line) for line in lines[:200])
        if record.stack_info:
            record.stack_info = "\n".join("  " + escape(line) for line in redact(record.stack_info).splitlines())
        record.raven_clean = True
        return True


def install(logger: logging.Logger | None = None) -> None:
    """Put :class:`SafeLines` on every handler of ``logger`` (the root logger by default)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, SafeLines) for f in handler.filters):
            handler.addFilter(SafeLines())
