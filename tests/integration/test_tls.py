"""Certificate rotation: new handshakes use the new files; a CA removed from the bundle is no longer trusted."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import threading
from pathlib import Path

import pytest

from raven import pki
from raven.config import TLSConfig
from raven.transport.tls import CertReloader, client_context


def make_ca(root: Path, name: str) -> Path:
    d = root / name
    pki.create_ca(d, common_name=f"CA {name}")
    pki.issue(d, d, "gateway", "gw", dns_names=["gw"])
    pki.issue(d, d, "agent", "agent-1", pools=["pool-a"])
    return d


def install(src: Path, live: Path) -> TLSConfig:
    live.mkdir(exist_ok=True)
    for f in ("gw.pem", "gw-key.pem", "ca.pem"):
        shutil.copy(src / f, live / f"new-{f}")
        (live / f"new-{f}").replace(live / f)  # atomic, like a Secret update
    return TLSConfig(cert=live / "gw.pem", key=live / "gw-key.pem", ca=live / "ca.pem", reload_interval=1)


def handshake(server: ssl.SSLContext, client_dir: Path, trust: Path) -> bool:
    client = client_context(TLSConfig(cert=client_dir / "agent-1.pem", key=client_dir / "agent-1-key.pem",
                                      ca=trust / "ca.pem"))
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError) as exc:
            errors.append(exc)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client.wrap_socket(b, server_hostname="gw") as c:
            c.sendall(b"x")
    except (ssl.SSLError, OSError) as exc:
        errors.append(exc)
    t.join(5)
    a.close()
    b.close()
    return not errors


def test_rotation_swaps_certificate_and_trust(tmp_path: Path) -> None:
    old = make_ca(tmp_path, "old")
    new = make_ca(tmp_path, "new")
    cfg = install(old, tmp_path / "live")
    reloader = CertReloader(cfg, server=True)
    assert handshake(reloader.listener, old, trust=old)
    assert not handshake(reloader.listener, new, trust=new)

    install(new, tmp_path / "live")
    os.utime(cfg.cert, (1, 2))  # make sure the stamp differs even within one second
    assert reloader.check()
    assert handshake(reloader.listener, new, trust=new)
    # The old CA left the bundle: agents it certified are refused now.
    assert not handshake(reloader.listener, old, trust=new)


def test_half_written_files_keep_the_current_context(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old = make_ca(tmp_path, "old")
    cfg = install(old, tmp_path / "live")
    reloader = CertReloader(cfg, server=True)
    before = reloader.current
    cfg.key.write_text("-----BEGIN PRIVATE KEY-----\ntruncated")
    assert not reloader.check()
    assert reloader.current is before
    assert "could not be loaded" in caplog.text
