"""A node's pages, compressed: the first of a run on its own (the key), the rest against the key.

Consecutive pages of one exporter differ mostly in values: with the key page as a raw-content zstd dictionary a
50 KB dcgm-exporter page takes about 600 bytes (level 1), against 3.2 KB on its own (docs/backfill.md has the
figures). The zstandard library (python-zstandard) does the work; nothing here keeps state but the caller's key.
"""

from __future__ import annotations

from typing import Final

import zstandard

LEVEL: Final = 1  # level 3 and 6 gain nothing on these pages and cost more CPU


class PageError(ValueError):
    """A blob that does not decompress (within the bound) with its key."""


def compress_key(page: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=LEVEL).compress(page)


def compress(page: bytes, key_page: bytes) -> bytes:
    d = zstandard.ZstdCompressionDict(key_page, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    return zstandard.ZstdCompressor(level=LEVEL, dict_data=d).compress(page)


def decompress_key(blob: bytes, max_size: int) -> bytes:
    return _decompress(zstandard.ZstdDecompressor(), blob, max_size)


def decompress(blob: bytes, key_page: bytes, max_size: int) -> bytes:
    d = zstandard.ZstdCompressionDict(key_page, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    return _decompress(zstandard.ZstdDecompressor(dict_data=d), blob, max_size)


def _decompress(dctx: zstandard.ZstdDecompressor, blob: bytes, max_size: int) -> bytes:
    try:
        params = zstandard.get_frame_parameters(blob)
        if params.content_size > max_size:  # unknown size reads as a huge number: refused too
            raise PageError(f"page of {params.content_size} bytes, limit {max_size}")
        out = dctx.decompress(blob, max_output_size=max_size)
    except zstandard.ZstdError as exc:
        raise PageError(f"page does not decompress: {exc}") from None
    if len(out) > max_size:
        raise PageError(f"page over {max_size} bytes")
    return out
