"""What the CA, issuing and reading certificates share: the URI prefixes that carry Raven's authorization
data, the roles, name rules, time formatting, and writing and reading key and certificate files.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from raven.errors import PKIError

POOL_URI_PREFIX = "urn:raven:pool:"
CIDR_URI_PREFIX = "urn:raven:cidr:"
AGENT_URI_PREFIX = "urn:raven:agent:"

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"

#: Roles that :func:`issue` can issue certificates for.
ROLES = ("gateway", "agent")

#: Leaf certificates start this long before "now" so that peers with a slow clock accept them.
CLOCK_SKEW = dt.timedelta(minutes=5)



def fmt_time(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_delta(delta: dt.timedelta) -> str:
    if delta.days >= 2:
        return f"{delta.days} days"
    hours = int(delta.total_seconds() // 3600)
    if hours >= 1:
        return f"{hours} hours"
    return f"{max(int(delta.total_seconds() // 60), 0)} minutes"


def dedupe(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


# --------------------------------------------------------------------------------------------------
# Files


def make_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise PKIError(f"cannot create directory {directory}: {exc.strerror or exc}") from exc
    if not directory.is_dir():
        raise PKIError(f"{directory} exists and is not a directory")


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` atomically; the file is created with ``mode`` from the start."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise PKIError(f"cannot write {path}: {exc.strerror or exc}") from exc


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def read_file(path: Path, what: str, hint: str = "") -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PKIError(f"{what} {path} not found{hint}") from None
    except IsADirectoryError:
        raise PKIError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise PKIError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
