"""Content codings both services use: whether a client accepts gzip, and the deflate implementation.

ISA-L's deflate (python-isal) when its wheel is there: at level 1 the same size as zlib's, in about half its CPU
time; else the standard library's zlib.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

try:
    from isal import isal_zlib as deflate
except ImportError:  # a platform without its wheel: the standard library's zlib, a little slower
    deflate = zlib  # type: ignore[misc]

__all__ = ["accepts_gzip", "deflate", "gzip_bytes"]


def accepts_gzip(values: Iterable[str]) -> bool:
    """Whether Accept-Encoding header values (RFC 9110 section 12.5.3) allow gzip."""
    gzip_q: float | None = None
    star_q: float | None = None
    for value in values:
        for item in value.split(","):
            coding, _, params = item.partition(";")
            coding = coding.strip().lower()
            q = 1.0
            for param in params.split(";"):
                name, _, number = param.partition("=")
                if name.strip().lower() == "q":
                    try:
                        q = float(number.strip())
                    except ValueError:
                        q = 0.0
            if coding in ("gzip", "x-gzip"):
                gzip_q = q if gzip_q is None else max(gzip_q, q)
            elif coding == "*":
                star_q = q
    if gzip_q is not None:
        return gzip_q > 0
    return star_q is not None and star_q > 0


MAX_LEVEL = 9 if deflate is zlib else 3  # ISA-L has levels 0-3 (3: about zlib's 6 in size, in a fraction of its time)


def gzip_bytes(data: bytes, level: int = 1) -> bytes:
    """``data`` as one gzip member (no file name, no time stamp: equal input, equal output); ``level`` is capped
    at what the library has."""
    packer = deflate.compressobj(min(level, MAX_LEVEL), deflate.DEFLATED, 16 + 15)
    return packer.compress(data) + packer.flush()
