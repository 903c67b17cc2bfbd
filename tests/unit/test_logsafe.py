"""What may reach a log line: secrets redacted, control characters escaped, lines bounded (raven/logsafe.py)."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from raven import logsafe

TOKEN = "s3cr3t-token-0123456789abcdef"


@pytest.mark.parametrize(
    "text",
    [
        f"b'GET / HTTP/1.1\\r\\nHost: a\\r\\nAuthorization: Bearer {TOKEN}\\r\\n\\r\\n'",
        f"GET / HTTP/1.1\nProxy-Authorization: Basic {TOKEN}\n",
        f"headers {{'authorization': 'Bearer {TOKEN}'}}",
        f"Cookie: session={TOKEN}; theme=dark",
        f"GET /metrics?token={TOKEN} -> 401",
        f"proxy http://prometheus:{TOKEN}@127.0.0.1:10263",
        f"the client said bearer {TOKEN}",
    ],
)
def test_credentials_are_redacted(text: str) -> None:
    out = logsafe.clean(text)
    assert TOKEN not in out
    assert logsafe.REDACTED in out


def test_registered_secrets_are_redacted_anywhere() -> None:
    def source() -> tuple[bytes, ...]:
        return (TOKEN.encode(),)

    logsafe.add_secrets(source)
    try:
        assert TOKEN not in logsafe.clean(f"GET /{TOKEN}/x from 10.0.0.1")
    finally:
        logsafe.remove_secrets(source)
    assert TOKEN in logsafe.clean(f"GET /{TOKEN}/x")  # no longer registered: a plain path stays readable


@pytest.mark.parametrize("text", [
    "node 'edge-gpu-7' (pool 'site-a') via agent agent-a-1: basic edge pool, why? 200",
    "front end: bearer tokens required (1 accepted)",
    "basic authentication is not offered",
])
def test_plain_text_is_left_alone(text: str) -> None:
    assert logsafe.clean(text) == text


@pytest.mark.parametrize("bad", ["\n", "\r", "\x00", "\x1b[31m", "\x85", "\u2028", "\u202e", "\x7f"])
def test_control_characters_are_escaped(bad: str) -> None:
    out = logsafe.clean(f"gateway is draining: x{bad}2026-11-25 12:00:00 ERROR forged line")
    assert bad not in out
    assert "\\" in out
    assert out.isprintable()


def test_long_lines_are_cut() -> None:
    out = logsafe.clean("A" * 100_000, limit=100)
    assert len(out) < 200 and out.endswith("characters cut]")


def test_path_for_log_drops_the_query() -> None:
    assert logsafe.path_for_log(f"/metrics?token={TOKEN}") == "/metrics?<redacted>"
    assert logsafe.path_for_log("/metrics") == "/metrics"


def _handler_output(record: logging.LogRecord) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(logsafe.SafeLines())
    handler.handle(record)
    return stream.getvalue()


def test_every_record_through_the_handler_is_one_safe_line() -> None:
    record = logging.LogRecord("t", logging.WARNING, __file__, 1, "agent said %s",
                               (f"x\nERROR forged\x1b[2J Authorization: Bearer {TOKEN}",), None)
    out = _handler_output(record)
    assert out.count("\n") == 1 and TOKEN not in out and "\\n" in out and "\x1b" not in out


def test_tracebacks_are_redacted_and_indented() -> None:
    try:
        raise ValueError(f"bad\n2026-01-01 00:00:00 ERROR forged Authorization: Bearer {TOKEN}")
    except ValueError:
        record = logging.LogRecord("t", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    out = _handler_output(record)
    assert TOKEN not in out
    first, *rest = out.splitlines()
    assert first.endswith("failed")
    assert rest and all(line.startswith("  ") for line in rest)  # no continuation line can pose as a record


def test_install_is_idempotent() -> None:
    logger = logging.getLogger("t.install")
    handler = logging.StreamHandler(io.StringIO())
    logger.addHandler(handler)
    try:
        logsafe.install(logger)
        logsafe.install(logger)
        assert sum(isinstance(f, logsafe.SafeLines) for f in handler.filters) == 1
    finally:
        logger.removeHandler(handler)
