"""TLS 1.3 contexts for both ends of the tunnel, with certificate rotation.

The gateway requires and verifies a client certificate; the agent verifies the gateway
against a pinned CA and server name. :class:`CertReloader` re-reads rotated files and
loads them into the *same* context, so new handshakes use the new certificate while
established sessions keep running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from pathlib import Path

from raven.config import TLSConfig

log = logging.getLogger("raven.tls")


class TLSError(Exception):
    pass


def _load(ctx: ssl.SSLContext, cfg: TLSConfig) -> None:
    try:
        ctx.load_cert_chain(str(cfg.cert), str(cfg.key))
    except (OSError, ssl.SSLError) as exc:
        raise TLSError(f"cannot load certificate {cfg.cert} with key {cfg.key}: {exc}") from None
    try:
        ctx.load_verify_locations(cafile=str(cfg.ca))
    except (OSError, ssl.SSLError) as exc:
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


def _stamp(paths: tuple[Path, ...]) -> tuple[float, ...]:
    out = []
    for p in paths:
        try:
            out.append(p.stat().st_mtime)
        except OSError:
            out.append(-1.0)
    return tuple(out)


class CertReloader:
    """Poll the certificate files and reload them into ``ctx`` when they change."""

    def __init__(self, ctx: ssl.SSLContext, cfg: TLSConfig) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.paths = (cfg.cert, cfg.key, cfg.ca)
        self._stamp = _stamp(self.paths)
        self._task: asyncio.Task[None] | None = None

    def check(self) -> bool:
        stamp = _stamp(self.paths)
        if stamp == self._stamp:
            return False
        try:
            _load(self.ctx, self.cfg)
        except TLSError as exc:
            # Half-written files during a rotation: keep the old ones and try again later.
            log.warning("certificate files changed but could not be loaded (keeping the current ones): %s", exc)
            return False
        self._stamp = stamp
        log.info("reloaded rotated certificate %s", self.cfg.cert)
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reload_interval)
            self.check()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cert-reloader")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
