"""TLS 1.3 contexts for both ends of the tunnel, with certificate rotation.

The gateway requires and verifies a client certificate; the agent verifies the gateway
against a pinned CA and server name. :class:`CertReloader` re-reads rotated files and
loads them into the *same* context, so new handshakes use the new certificate while
established sessions keep running.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from raven.aio import cancel_and_wait
from raven.config import TLSConfig
from raven.errors import TLSError

log = logging.getLogger("raven.transport.tls")


def _load(ctx: ssl.SSLContext, cfg: TLSConfig) -> None:
    try:
        ctx.load_cert_chain(str(cfg.cert), str(cfg.key))
    except ssl.SSLError as exc:
        raise TLSError(f"cannot load certificate {cfg.cert} with key {cfg.key}: not PEM files, or the key does not "
                       f"belong to the certificate ({exc})") from None
    except OSError as exc:
        raise TLSError(f"cannot load certificate {cfg.cert} with key {cfg.key}: {exc}") from None
    try:
        ctx.load_verify_locations(cafile=str(cfg.ca))
    except ssl.SSLError as exc:
        raise TLSError(f"cannot load CA bundle {cfg.ca}: not a PEM file of certificates ({exc})") from None
    except OSError as exc:
        raise TLSError(f"cannot load CA bundle {cfg.ca}: {exc}") from None


def server_context(cfg: TLSConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load(ctx, cfg)
    return ctx


def client_context(cfg: TLSConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load(ctx, cfg)
    return ctx


HandshakeErrorHook = Callable[[ssl.SSLError], None]


def reporting_sslobject(report: HandshakeErrorHook) -> type[ssl.SSLObject]:
    """An SSLObject class that hands every failed handshake to ``report`` before raising.

    asyncio and uvloop log a failed server-side handshake only in debug mode; without this a
    client certificate from the wrong CA, or plain HTTP sent to the tunnel port, leaves no trace.
    """

    class ReportingSSLObject(ssl.SSLObject):
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise
            except ssl.SSLError as exc:
                report(exc)
                raise

    return ReportingSSLObject


def _stamp(paths: tuple[Path, ...]) -> tuple[float, ...]:
    out = []
    for p in paths:
        try:
            out.append(p.stat().st_mtime)
        except OSError:
            out.append(-1.0)
    return tuple(out)


class CertReloader:
    """Re-read rotated certificate files into a *fresh* context and use it for new handshakes.

    A fresh context (rather than loading into the old one) matters for the CA bundle: a CA
    removed from the file stops being trusted. On the server side the listener keeps one
    context whose SNI hook (called for every ClientHello, with or without SNI) hands the
    handshake to the current context. Established sessions are not touched.
    """

    def __init__(self, cfg: TLSConfig, server: bool, on_handshake_error: HandshakeErrorHook | None = None,
                 on_loaded: Callable[[TLSConfig], None] | None = None) -> None:
        self.cfg = cfg
        self.on_loaded = on_loaded  # told after every (re)load, e.g. to export the certificates' expiry
        self.server = server
        self._build = server_context if server else client_context
        self.paths = (cfg.cert, cfg.key, cfg.ca)
        self._stamp = _stamp(self.paths)
        self.current = self._build(cfg)
        self.listener = self.current
        if server:
            self.listener = self._build(cfg)
            self.listener.sni_callback = self._select
            if on_handshake_error is not None:
                self.listener.sslobject_class = reporting_sslobject(on_handshake_error)
        self._task: asyncio.Task[None] | None = None
        if on_loaded is not None:
            on_loaded(cfg)

    def _select(self, ssl_obj: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        ssl_obj.context = self.current

    def check(self) -> bool:
        stamp = _stamp(self.paths)
        if stamp == self._stamp:
            return False
        try:
            fresh = self._build(self.cfg)
        except TLSError as exc:
            # Half-written files during a rotation: keep the old ones and try again later.
            log.warning("certificate files changed but could not be loaded (keeping the current ones): %s", exc)
            return False
        self.current = fresh
        self._stamp = stamp
        log.info("reloaded rotated certificate %s and CA bundle %s for new connections", self.cfg.cert, self.cfg.ca)
        if self.on_loaded is not None:
            self.on_loaded(self.cfg)
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reload_interval)
            self.check()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cert-reloader")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None


def expiries(cfg: TLSConfig, role: str) -> list[tuple[str, str, float]]:
    """(role, subject common name, notAfter in Unix seconds) of the certificate and of every CA in the bundle."""
    out: list[tuple[str, str, float]] = []
    for path, what in ((cfg.cert, role), (cfg.ca, "ca")):
        try:
            certs = x509.load_pem_x509_certificates(path.read_bytes())
        except (OSError, ValueError):
            continue
        for cert in certs[:1] if what == role else certs:
            names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            subject = str(names[0].value) if names else cert.subject.rfc4514_string()
            out.append((what, subject[:128], cert.not_valid_after_utc.timestamp()))
    return out
