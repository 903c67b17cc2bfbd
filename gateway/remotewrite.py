"""Prometheus remote-write 1.0 requests: a ``WriteRequest`` protobuf, snappy-compressed (block format).

The message is small and fixed (prometheus/prompb/remote.proto and types.proto), so it is written here field by
field rather than with a generated module and the protobuf runtime:

    WriteRequest { repeated TimeSeries timeseries = 1; }
    TimeSeries   { repeated Label labels = 1; repeated Sample samples = 2; }
    Label        { string name = 1; string value = 2; }
    Sample       { double value = 1; int64 timestamp = 2; }   // timestamp: Unix milliseconds

A series' labels go sorted by name (the receiver requires it) and its samples in time order. :func:`decode` reads
a request back (the tests check the encoder with it). Snappy is cramjam's.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable
from typing import Final

import cramjam

Labels = tuple[tuple[str, str], ...]
Series = tuple[Labels, list[tuple[int, float]]]  # sorted labels, (timestamp ms, value) in time order

HEADERS: Final = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
}
_DOUBLE = struct.Struct("<d")


_SMALL: Final = tuple(bytes((i,)) for i in range(128))


def varint(n: int) -> bytes:
    """A protobuf varint (an int64 below zero takes ten bytes, as protobuf writes it)."""
    if 0 <= n < 128:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64  # int64 as protobuf writes it: ten bytes for a negative number
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def label(name: str, value: str) -> bytes:
    """One encoded Label field of a TimeSeries (field 1 of it: fields 1 and 2, the name and the value)."""
    n, v = name.encode(), value.encode()
    body = b"\x0a" + varint(len(n)) + n + b"\x12" + varint(len(v)) + v
    return b"\x0a" + varint(len(body)) + body


@functools.lru_cache(maxsize=1 << 15)
def _labels(labels: Labels) -> bytes:
    """A series' encoded labels: the same series come in every scrape of a node (bounded cache)."""
    return b"".join(label(k, v) for k, v in labels)


def _sample(ts_ms: int, value: float) -> bytes:
    body = b"\x09" + _DOUBLE.pack(value) + b"\x10" + varint(ts_ms)  # field 1 fixed64, field 2 varint
    return _field(2, body)


def encode(series: Iterable[Series]) -> bytes:
    """The uncompressed WriteRequest."""
    out = bytearray()
    for labels, samples in series:
        body = _labels(labels) + b"".join(_sample(t, v) for t, v in samples)
        out += _field(1, body)
    return bytes(out)


def compress(message: bytes) -> bytes:
    return bytes(cramjam.snappy.compress_raw(message))


def decompress(body: bytes) -> bytes:
    return bytes(cramjam.snappy.decompress_raw(body))


# ---------------------------------------------------------------- reading back (tests, and a receiver stand-in)


def _read_varint(buf: bytes, at: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[at]
        at += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, at
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: bytes) -> Iterable[tuple[int, int, bytes | int]]:
    at = 0
    while at < len(buf):
        key, at = _read_varint(buf, at)
        number, kind = key >> 3, key & 7
        if kind == 2:
            n, at = _read_varint(buf, at)
            if at + n > len(buf):
                raise ValueError("field runs past the message")
            yield number, kind, buf[at:at + n]
            at += n
        elif kind == 1:
            yield number, kind, buf[at:at + 8]
            at += 8
        elif kind == 0:
            v, at = _read_varint(buf, at)
            yield number, kind, v
        else:
            raise ValueError(f"wire type {kind}")


def decode(message: bytes) -> list[Series]:
    out: list[Series] = []
    for _, _, ts_body in _fields(message):
        labels: list[tuple[str, str]] = []
        samples: list[tuple[int, float]] = []
        assert isinstance(ts_body, bytes)
        for number, _, part in _fields(ts_body):
            assert isinstance(part, bytes)
            got = {n: v for n, _, v in _fields(part)}
            if number == 1:
                name, value = got.get(1, b""), got.get(2, b"")
                assert isinstance(name, bytes) and isinstance(value, bytes)
                labels.append((name.decode(), value.decode()))
            else:
                raw, ts = got.get(1, bytes(8)), got.get(2, 0)
                assert isinstance(raw, bytes) and isinstance(ts, int)
                samples.append((ts - (1 << 64) if ts >= 1 << 63 else ts, _DOUBLE.unpack(raw)[0]))
        out.append((tuple(labels), samples))
    return out
