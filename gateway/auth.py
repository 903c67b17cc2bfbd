"""Who may use the front end and the inventory endpoints: bearer tokens from files, the way Prometheus sends them.

- Host-header mode (origin-form target): ``Authorization: Bearer <token>``, what Prometheus sends with
  ``authorization: {credentials_file: ...}`` in a scrape config. Missing or wrong: 401 with
  ``WWW-Authenticate: Bearer realm="raven"``.
- Proxy mode (absolute-URI target, and CONNECT): ``Proxy-Authorization``, what Prometheus sends for
  ``proxy_url: http://USER:TOKEN@gateway:10263`` (``Basic base64(USER:TOKEN)``, any user name); ``Bearer`` is
  accepted too. Missing or wrong: 407 with ``Proxy-Authenticate: Basic realm="raven"``. The client's own
  ``Authorization`` belongs to the target then and passes through.

Token files hold one token per line (blank lines and surrounding white space ignored). They are re-read
when they change (checked at most every ``reload_interval``), so tokens rotate without a restart: put the new
token beside the old one, move Prometheus over, then remove the old one. Every presented credential is compared
with every token in constant time; a credential is never logged or echoed.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from raven.errors import ConfigError
from raven.refusals import Reason, Refusal

log = logging.getLogger("raven.gateway.auth")

MAX_CREDENTIAL = 4096


class TokenError(ConfigError):
    """A token file cannot be used; the message names the file."""


def read_tokens(paths: Sequence[Path]) -> tuple[bytes, ...]:
    tokens: list[bytes] = []
    for path in paths:
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise TokenError(f"cannot read token file {str(path)!r}: {exc.strerror or exc}") from None
        found = [line.strip() for line in text.splitlines() if line.strip()]
        if not found:
            raise TokenError(f"token file {str(path)!r} holds no token")
        for token in found:
            if len(token) < 16:
                raise TokenError(f"a token in {str(path)!r} is shorter than 16 characters: use a long random one "
                                 "(e.g. 'openssl rand -hex 32')")
        tokens.extend(found)
    return tuple(tokens)


def _stamp(paths: Sequence[Path]) -> tuple[tuple[int, int, int], ...]:
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((0, 0, 0))
    return tuple(out)


class TokenSet:
    """The tokens of some files, re-read when the files change; a bad new version keeps the old tokens."""

    def __init__(self, paths: Sequence[Path], reload_interval: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.paths = tuple(paths)
        self.reload_interval = reload_interval
        self.clock = clock
        self._tokens = read_tokens(self.paths)  # at start, a bad file is an error (raised)
        self._stamp = _stamp(self.paths)
        self._checked = clock()

    def tokens(self) -> tuple[bytes, ...]:
        now = self.clock()
        if now - self._checked >= self.reload_interval:
            self._checked = now
            stamp = _stamp(self.paths)
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._tokens = read_tokens(self.paths)
                    log.info("front-end tokens reloaded from %s (%d token(s))",
                             ", ".join(str(p) for p in self.paths), len(self._tokens))
                except TokenError as exc:
                    log.error("%s; keeping the %d token(s) loaded before", exc, len(self._tokens))
        return self._tokens

    def current(self) -> tuple[bytes, ...]:
        """The tokens as last read, without looking at the files (for redacting log lines)."""
        return self._tokens

    def accepts(self, presented: bytes) -> bool:
        """Constant time in the presented value, and every token is compared (no early exit)."""
        ok = False
        for token in self.tokens():
            ok |= hmac.compare_digest(presented, token)
        return ok


# A request's fields by name: every value of a field, in order (``lambda n: request.headers.getall(n, [])``).
FieldValues = Callable[[str], Sequence[str]]


def _one(fields: FieldValues, name: str) -> str | Refusal:
    """The field's single value ("" when absent); a field sent twice is ambiguous (an intermediary may read the
    other one) and refused."""
    values = fields(name)
    if len(values) > 1:
        return Refusal(Reason.DUPLICATE_FIELD, f"the request has {len(values)} {name} fields: a credential must be "
                       "sent once")
    return values[0] if values else ""


_BEARER_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="raven"'}
_PROXY_CHALLENGE = {"Proxy-Authenticate": 'Basic realm="raven"'}


def _credential(value: str, allow_basic: bool) -> bytes | None:
    """The secret in an Authorization-style header value: a Bearer token, or (proxy) a Basic password."""
    if not value or len(value) > MAX_CREDENTIAL:
        return None
    scheme, _, rest = value.strip().partition(" ")
    rest = rest.strip()
    if scheme.lower() == "bearer" and rest:
        return rest.encode("latin-1", "replace")
    if allow_basic and scheme.lower() == "basic" and rest:
        try:
            decoded = base64.b64decode(rest, validate=True)
        except (binascii.Error, ValueError):
            return None
        _, sep, password = decoded.partition(b":")
        return password if sep and password else None
    return None


class FrontAuth:
    """Checks a front-end request's credentials; ``None`` tokens means the front end is open."""

    def __init__(self, tokens: TokenSet | None) -> None:
        self.tokens = tokens

    @property
    def enabled(self) -> bool:
        return self.tokens is not None

    def describe(self, tls: bool, mode: str | None, listen: str) -> tuple[int, str]:
        """The start's line about who may use the front end: (log level, text)."""
        if self.tokens is not None:
            return logging.INFO, f"front end: bearer tokens required ({len(self.tokens.tokens())} accepted)"
        if tls:
            return logging.INFO, "front end: client certificates required (TLS)"
        if mode == "none":
            return logging.WARNING, (f"front end: NO credentials required (front.auth.mode: none): anything that "
                                     f"reaches {listen} can scrape every edge node; limit it with a NetworkPolicy")
        return logging.INFO, "front end: no credentials required (it listens on loopback only)"

    def check(self, fields: FieldValues, proxy_mode: bool) -> Refusal | None:
        # Duplicates are refused even when no token is required: the node must not get an ambiguous request.
        proxy_value = _one(fields, "Proxy-Authorization")
        if isinstance(proxy_value, Refusal):
            return proxy_value
        value = _one(fields, "Authorization")
        if isinstance(value, Refusal):
            return value
        if self.tokens is None:
            return None
        if proxy_mode:
            presented = _credential(proxy_value, allow_basic=True)
            if presented is None:
                return Refusal(Reason.PROXY_AUTH_REQUIRED, "proxy credentials required (Proxy-Authorization: the token "
                               "as the password of proxy_url's user info, or Bearer)", _PROXY_CHALLENGE)
            if not self.tokens.accepts(presented):
                return Refusal(Reason.PROXY_AUTH_REQUIRED, "the proxy credentials were not accepted", _PROXY_CHALLENGE)
            return None
        presented = _credential(value, allow_basic=False)
        if presented is None:
            return Refusal(Reason.AUTH_REQUIRED, "credentials required (Authorization: Bearer <token>)",
                           _BEARER_CHALLENGE)
        if not self.tokens.accepts(presented):
            return Refusal(Reason.AUTH_REQUIRED, "the bearer token was not accepted", _BEARER_CHALLENGE)
        return None

    def check_bearer(self, fields: FieldValues) -> Refusal | None:
        """For the ops port's inventory endpoints: always ``Authorization: Bearer``."""
        return self.check(fields, proxy_mode=False)

    def check_browser(self, fields: FieldValues) -> Refusal | None:
        """For the status page: a browser asks for a user name and password (any user, the token as password);
        ``Authorization: Bearer`` works too."""
        value = _one(fields, "Authorization")
        if isinstance(value, Refusal):
            return value
        if self.tokens is None:
            return None
        presented = _credential(value, allow_basic=True)
        if presented is not None and self.tokens.accepts(presented):
            return None
        return Refusal(Reason.AUTH_REQUIRED, "credentials required (the front end's token as the password, any user "
                       "name)", {"WWW-Authenticate": 'Basic realm="raven", charset="UTF-8"'})
