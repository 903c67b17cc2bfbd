"""gateway/auth.py without sockets: token files, rotation, the two credential forms and duplicated fields."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from gateway.auth import FieldValues, FrontAuth, TokenError, TokenSet

TOKEN = "token-one-0123456789abcdef"
OTHER = "token-two-fedcba9876543210"


def fields(**pairs: str | list[str]) -> FieldValues:
    named = {k.replace("_", "-").lower(): (v if isinstance(v, list) else [v]) for k, v in pairs.items()}
    return lambda name: named.get(name.lower(), [])


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_token_files(tmp_path: Path) -> None:
    tokens = TokenSet([write(tmp_path / "a", f"\n  {TOKEN}  \n\n{OTHER}\n")])
    assert tokens.current() == (TOKEN.encode(), OTHER.encode())
    assert tokens.accepts(TOKEN.encode()) and not tokens.accepts(b"nope")
    for bad in ("", "short\n"):
        with pytest.raises(TokenError):
            TokenSet([write(tmp_path / "b", bad)])
    with pytest.raises(TokenError, match="cannot read"):
        TokenSet([tmp_path / "missing"])


def test_rotation_and_a_bad_new_file_keeps_the_old_tokens(tmp_path: Path) -> None:
    now = [0.0]
    path = write(tmp_path / "t", TOKEN + "\n")
    tokens = TokenSet([path], reload_interval=2.0, clock=lambda: now[0])
    write(path, OTHER + "\n")
    assert tokens.accepts(TOKEN.encode())  # not looked at again before reload_interval
    now[0] = 3.0
    assert tokens.accepts(OTHER.encode()) and not tokens.accepts(TOKEN.encode())
    write(path, "")
    now[0] = 6.0
    assert tokens.accepts(OTHER.encode())  # an empty file keeps the tokens loaded before


@pytest.fixture
def auth(tmp_path: Path) -> FrontAuth:
    return FrontAuth(TokenSet([write(tmp_path / "t", TOKEN + "\n")]))


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_host_mode_takes_a_bearer_token(auth: FrontAuth) -> None:
    assert auth.check(fields(Authorization=f"Bearer {TOKEN}"), proxy_mode=False) is None
    for value in (f"Bearer {OTHER}", basic("x", TOKEN), "", f"Token {TOKEN}", "Bearer " + "x" * 5000):
        denied = auth.check(fields(Authorization=value), proxy_mode=False)
        assert denied is not None and denied.status == 401 and "WWW-Authenticate" in denied.headers


def test_proxy_mode_takes_basic_or_bearer_proxy_credentials(auth: FrontAuth) -> None:
    assert auth.check(fields(Proxy_Authorization=basic("prometheus", TOKEN)), proxy_mode=True) is None
    assert auth.check(fields(Proxy_Authorization=f"Bearer {TOKEN}"), proxy_mode=True) is None
    for value in (basic("prometheus", OTHER), basic(TOKEN, ""), "Basic !!!", ""):
        denied = auth.check(fields(Proxy_Authorization=value), proxy_mode=True)
        assert denied is not None and denied.status == 407 and "Proxy-Authenticate" in denied.headers
    # The client's own Authorization is for the target in proxy mode, never a gateway credential.
    denied = auth.check(fields(Authorization=f"Bearer {TOKEN}"), proxy_mode=True)
    assert denied is not None and denied.status == 407


@pytest.mark.parametrize("name", ["Authorization", "Proxy-Authorization"])
@pytest.mark.parametrize("order", [(TOKEN, OTHER), (OTHER, TOKEN)])
def test_a_credential_field_sent_twice_is_refused(auth: FrontAuth, name: str, order: tuple[str, str]) -> None:
    values = [f"Bearer {t}" for t in order]
    for proxy_mode in (False, True):
        denied = auth.check(fields(**{name.replace("-", "_"): values}), proxy_mode=proxy_mode)
        assert denied is not None and denied.status == 400 and denied.label == "duplicate-field"
        assert name in denied.text
    denied = FrontAuth(None).check(fields(**{name.replace("-", "_"): values}), proxy_mode=False)
    assert denied is not None and denied.status == 400  # ambiguous even when no token is required


def test_the_status_page_takes_the_token_as_a_password(auth: FrontAuth) -> None:
    assert auth.check_browser(fields(Authorization=basic("anyone", TOKEN))) is None
    assert auth.check_browser(fields(Authorization=f"Bearer {TOKEN}")) is None
    denied = auth.check_browser(fields(Authorization=basic("anyone", OTHER)))
    assert denied is not None and denied.status == 401
    assert FrontAuth(None).check_browser(fields()) is None
