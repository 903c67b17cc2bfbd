"""The one reader of an ops endpoint over HTTP: a gateway's ops listener (``/status``, ``/nodes``, ``/metrics``) for
``raven status``, ``raven hosts``, ``raven dns check`` and ``raven check``, and Prometheus's HTTP API for
``raven check``.

Bounded: one deadline for the whole request (``timeout``), and at most ``max_bytes`` of body (a replica's
``/status`` of 10,000 nodes is a few MB; ``MAX_BYTES`` leaves room for ten times that). Every failure is an
:class:`OpsReadError` whose message says which URL and why, never a traceback. A reply also says when it was
sent and received (this machine's wall clock) and the server's ``Date`` header, for ``raven check``'s clock check.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from raven.errors import CommandFailed, UsageError

MAX_BYTES = 64 << 20


class OpsReadError(CommandFailed):
    """An ops endpoint could not be read (the message names the URL and the reason)."""


@dataclass(frozen=True)
class Reply:
    url: str
    body: bytes
    sent: float  # this machine's wall clock when the request left
    received: float  # ... and when the whole body was in
    date: float | None  # the server's Date header (whole seconds), None when it sent none

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):
            raise OpsReadError(f"{self.url} is not JSON (is it a Raven gateway's ops listener?)") from None


def parse_date(value: str | None) -> float | None:
    if not value:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
        return (when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


async def _read_body(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes | None:
    """The whole body, or None once it passes ``max_bytes`` (``read(n)`` returns what has arrived, not n bytes)."""
    body = bytearray()
    while chunk := await resp.content.read(min(1 << 20, max_bytes + 1 - len(body))):
        body += chunk
        if len(body) > max_bytes:
            return None
    return bytes(body)


async def get(url: str, token: str | None = None, timeout: float = 10.0, max_bytes: int = MAX_BYTES,
              params: dict[str, str] | None = None) -> Reply:
    """GET ``url`` (with ``Authorization: Bearer token`` when given): the 200 reply, or OpsReadError."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    sent = time.time()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            async with http.get(url, headers=headers, params=params, allow_redirects=False) as resp:
                if resp.status == 401:
                    raise OpsReadError(f"{url} needs the front end's bearer token: pass --token-file FILE"
                                       if not token else f"{url} refused the token (401): pass --token-file with "
                                       "one of front.auth's tokens")
                if resp.status != 200:
                    raise OpsReadError(f"{url} answered HTTP {resp.status}")
                body = await _read_body(resp, max_bytes)
                if body is None:
                    raise OpsReadError(f"{url} sent more than {max_bytes >> 20} MiB")
                return Reply(url, body, sent, time.time(), parse_date(resp.headers.get("Date")))
    except aiohttp.ClientConnectorError as exc:
        raise OpsReadError(f"cannot connect to {url}: {exc.os_error.strerror or exc.os_error}") from None
    except TimeoutError:
        raise OpsReadError(f"{url} did not answer within {timeout:g}s") from None
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise OpsReadError(f"cannot read {url}: {type(exc).__name__}: {exc}") from None


async def get_json(base: str, path: str, token: str | None = None, timeout: float = 10.0,
                   max_bytes: int = MAX_BYTES) -> Any:
    """The JSON document at ``base`` + ``path``, or OpsReadError."""
    return (await get(base.rstrip("/") + path, token, timeout, max_bytes)).json()


def read_token_file(path: Path | None) -> str | None:
    """The bearer token in ``path`` (its first non-empty line; never taken from the command line), or None."""
    if path is None:
        return None
    try:
        token = next((line.strip() for line in path.read_text().splitlines() if line.strip()), "")
    except OSError as exc:
        raise UsageError(f"cannot read --token-file {str(path)!r}: {exc.strerror or exc}") from None
    if not token:
        raise UsageError(f"--token-file {str(path)!r} holds no token")
    return token
