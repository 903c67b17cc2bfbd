"""agent/compress.py: when the agent gzips a response, the head it sends, and the streaming encoder."""

from __future__ import annotations

import gzip
import zlib

import pytest

from agent.compress import FLUSH_BYTES, MIN_BYTES, Gzip, accepts_gzip, plan
from raven.demo.simexporter import render_metrics
from raven.protocol import wire

GZIP_OK: wire.Headers = (("Accept-Encoding", "gzip"),)
PLAIN: wire.Headers = (("Content-Type", "text/plain; version=0.0.4"), ("Content-Length", "51200"))


@pytest.mark.parametrize(("values", "expected"), [
    (["gzip"], True),
    (["gzip, deflate"], True),
    (["deflate, GZIP;q=0.5"], True),
    (["x-gzip"], True),
    (["*"], True),
    (["identity"], False),
    (["gzip;q=0"], False),
    (["gzip;q=0.000", "*"], False),  # gzip named with q=0 wins over the wildcard
    (["*;q=0"], False),
    (["br", "zstd"], False),
    (["gzip;q=nonsense"], False),
    ([], False),
])
def test_accepts_gzip(values: list[str], expected: bool) -> None:
    assert accepts_gzip(values) is expected


def test_plan_rewrites_the_head() -> None:
    head = (*PLAIN, ("Vary", "Origin"), ("ETag", '"abc"'))
    gz, out = plan("auto", "GET", 200, GZIP_OK, head)
    assert gz is not None
    names = [n.lower() for n, _ in out]
    assert "content-length" not in names
    assert ("Content-Encoding", "gzip") in out
    assert ("Vary", "Origin, Accept-Encoding") in out
    assert ("ETag", 'W/"abc"') in out
    _, plain_vary = plan("auto", "GET", 200, GZIP_OK, PLAIN)
    assert ("Vary", "Accept-Encoding") in plain_vary


@pytest.mark.parametrize(("mode", "method", "status", "request_headers", "response_headers"), [
    ("never", "GET", 200, GZIP_OK, PLAIN),
    ("auto", "HEAD", 200, GZIP_OK, PLAIN),
    ("auto", "GET", 204, GZIP_OK, ()),
    ("auto", "GET", 304, GZIP_OK, ()),
    ("auto", "GET", 206, GZIP_OK, PLAIN),
    ("auto", "GET", 200, (), PLAIN),
    ("auto", "GET", 200, (("Accept-Encoding", "identity"),), PLAIN),
    ("auto", "GET", 200, GZIP_OK, (("Content-Encoding", "gzip"),)),  # the node compressed: never twice
    ("auto", "GET", 200, GZIP_OK, (("Content-Encoding", "br"),)),
    ("auto", "GET", 200, GZIP_OK, (("Cache-Control", "max-age=0, no-transform"),)),
    ("auto", "GET", 200, GZIP_OK, (("Content-Length", str(MIN_BYTES - 1)),)),  # tiny
])
def test_plan_leaves_alone(mode: str, method: str, status: int, request_headers: wire.Headers,
                           response_headers: wire.Headers) -> None:
    gz, out = plan(mode, method, status, request_headers, response_headers)  # type: ignore[arg-type]
    assert gz is None
    assert out == response_headers


def test_the_gateways_hint_that_the_uplink_is_free_leaves_it_alone_under_auto() -> None:
    assert plan("auto", "GET", 200, GZIP_OK, PLAIN, uplink_free=True) == (None, PLAIN)
    assert plan("auto", "GET", 200, GZIP_OK, PLAIN, uplink_free=False)[0] is not None


def test_always_overrides_the_gateways_hint_but_not_the_client() -> None:
    assert plan("always", "GET", 200, GZIP_OK, PLAIN, uplink_free=True)[0] is not None
    assert plan("always", "GET", 200, (), PLAIN)[0] is None
    assert plan("auto", "GET", 200, GZIP_OK, (("Content-Encoding", "identity"), *PLAIN))[0] is not None


def dcgm_page() -> bytes:
    return render_metrics("edge-gpu-7", gpus=8)  # dcgm-exporter's shape: fixed labels per GPU


def test_streaming_decodes_to_exactly_the_input_in_any_chunking() -> None:
    page = dcgm_page() * 4  # ~200 KiB: several flushes
    for size in (1, 1000, 16 * 1024, FLUSH_BYTES, len(page)):
        gz = Gzip()
        pieces = [page[i:i + size] for i in range(0, len(page), size)] if size > 1 else [page[:5000], page[5000:]]
        out = b"".join(gz.feed(p, last=(i == len(pieces) - 1)) for i, p in enumerate(pieces))
        assert gzip.decompress(out) == page
        assert gz.raw == len(page) and gz.wire == len(out)


def test_a_dcgm_page_shrinks_to_a_tenth() -> None:
    page = dcgm_page()
    gz = Gzip()
    out = gz.feed(page, last=True)
    assert len(out) <= len(page) // 10, (len(out), len(page))


def test_output_is_flushed_every_flush_bytes_and_memory_stays_bounded() -> None:
    gz = Gzip()
    page = dcgm_page()
    fed = 0
    decoder = zlib.decompressobj(31)
    decoded = b""
    while fed < 4 * FLUSH_BYTES:
        out = gz.feed(page[:4096], last=False)
        fed += 4096
        decoded += decoder.decompress(out)
        # After a sync flush everything fed so far can be decoded: nothing waits inside past FLUSH_BYTES.
        assert fed - len(decoded) < FLUSH_BYTES + 4096
    assert decoded == (page[:4096] * (fed // 4096))[:len(decoded)]


def test_a_stream_without_its_last_piece_is_not_a_whole_gzip() -> None:
    gz = Gzip()
    out = gz.feed(dcgm_page() * 2, last=False) + gz.feed(b"", last=False)  # past a flush point, no trailer
    assert out
    with pytest.raises(EOFError):
        gzip.decompress(out)


def test_output_leaves_only_at_flush_points() -> None:
    """One tunnel frame per flush: nothing (not even the gzip header) leaves between two flushes."""
    gz = Gzip()
    page = dcgm_page()
    assert gz.feed(page[:1000], last=False) == b""
    assert gz.feed(page[1000:20000], last=False) == b""
    whole = gz.feed(page[20000:], last=True)
    assert gzip.decompress(whole) == page
