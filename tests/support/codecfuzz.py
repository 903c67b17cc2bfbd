"""What this build's codec and session core make of fuzzed bytes, as comparable text (tests/unit/test_build.py).

Run as ``python -m tests.support.codecfuzz SEED COUNT``: prints one JSON object, the build that ran
(raven.build.running) and, for every input, what ``wire.decode``, ``wire.split_batch`` and a fresh agent-side
connection's ``receive`` gave: the frame or events (memoryviews as bytes, dataclasses field by field), or the
exception's type and message. The inputs are valid frames and batches of both protocol versions (taken from
a session pair's own output) and their mutations: flipped bytes, truncations, splices and random bytes, from
a seeded generator, so two processes given the same seed see the same bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import random
import sys
from collections.abc import Callable

from raven import build
from raven.protocol import wire
from tests.support.memsession import core_pair


def _valid_messages() -> list[bytes]:
    out: list[bytes] = []
    for version in (1, 2, 3):
        gw, ag = core_pair(65536, 8, version=version)
        for fin in (True, False):
            sid = gw.open_stream(wire.Open(0, wire.StreamKind.HTTP, "edge-1", 9400, "GET", "/metrics",
                                           (("accept", "text/plain"), ("x-a", "b")), fin))
            for message in gw.data_to_send():
                out.append(bytes(message))
                ag.receive(message, 0.0)
            ag.send_head(sid, 200, "OK", (("content-type", "text/plain"),))
            ag.send_data(sid, b"gpu_util 42\n" * 40, fin=fin)
            if not fin:
                gw.reset_stream(sid, wire.ResetCode.CANCEL, "gone")
            out += [bytes(m) for m in ag.data_to_send()]
            out += [bytes(m) for m in gw.data_to_send()]
    for frame in (wire.Ping(7), wire.Pong(7), wire.Drain("bye"), wire.GoAway(0, "done"), wire.Window(3, 100),
                  wire.End(3), wire.Register((wire.NodeInfo("edge-1", "pool", "10.0.0.1"),)),
                  wire.Registered(("edge-1",), (("edge-2", "not yours"),))):
        out.append(wire.encode(frame))
    return out


def _mutate(rng: random.Random, base: bytes) -> bytes:
    data = bytearray(base)
    kind = rng.randrange(5)
    if kind == 0 and data:  # flip a few bytes
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:  # truncate
        del data[rng.randrange(len(data) + 1):]
    elif kind == 2:  # splice random bytes in
        pos = rng.randrange(len(data) + 1)
        data[pos:pos] = rng.randbytes(rng.randint(1, 16))
    elif kind == 3:  # random bytes with a plausible header
        data = bytearray(data[:rng.randint(0, 9)] + rng.randbytes(rng.randint(0, 64)))
    return bytes(data)  # kind 4: unchanged


def _plain(value: object) -> object:
    if isinstance(value, memoryview | bytes | bytearray):
        return bytes(value).hex()
    if isinstance(value, enum.IntEnum):  # a field typed int holds the plain int once compiled code passed it on
        return int(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [type(value).__name__, {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}]
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return f"{type(value).__name__}: {value}"


def _outcome(call: Callable[..., object], *args: object) -> object:
    try:
        return _plain(call(*args))
    except Exception as exc:  # what each build raises is the point: compared, never swallowed
        return ["raised", type(exc).__name__, str(exc), getattr(exc, "stream_id", None)]


def run(seed: int, count: int) -> dict[str, object]:
    rng = random.Random(seed)
    valid = _valid_messages()
    results = []
    for i in range(count):
        message = valid[i] if i < len(valid) else _mutate(rng, rng.choice(valid))
        _, acceptor = core_pair(65536, 8, version=rng.choice((1, 2, 3)))  # the agent's side, after its WELCOME
        results.append([message.hex(), _outcome(wire.decode, message), _outcome(wire.split_batch, message),
                        _outcome(acceptor.receive, message, 0.0), _outcome(acceptor.data_to_send)])
    return {"build": build.running(), "results": results}


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]), int(sys.argv[2]))))
