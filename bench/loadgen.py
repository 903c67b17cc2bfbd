"""One process of the fleet benchmark's load generator (bench/bench_fleet.py starts several).

Each worker owns a slice of the node names (name ``i`` of ``total`` when ``i % workers == index``) and scrapes
each of them once per ``total / rate`` seconds at the name's own offset in that interval, as Prometheus spreads
its targets: together the workers issue ``rate`` scrapes per second over all names, open loop (a scrape is sent
when it is due, whatever the others are doing). Modes:

- ``pool``: the worker's share of ``--pool-size`` keep-alive connections to the front end; a due scrape takes
  an idle one or waits for one (first come, first served);
- ``per-node``: one keep-alive connection per owned name, as Prometheus in DNS mode holds them, each opened
  at its name's first scrape (the first cycle, ``total / rate`` seconds, opens them all: keep the warm-up
  longer than that);
- ``direct``: the same as ``pool``, but to the exporter itself (no Raven): the generator's and the exporter's
  own share of a scrape's latency.

The HTTP client is a small asyncio protocol (request bytes prepared once per name, Content-Length and chunked
bodies counted, not kept), much cheaper per request than aiohttp's client: the point is that the generator is
not what gets measured. For each scrape it records when it was due, how late it was sent (the generator's
lag: pacing, a wait for a pooled connection, its own event loop being busy), the latency from the write to the
last byte, and the status. It prints one JSON object on stdout at the end, and its CPU seconds.

    python bench/loadgen.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import resource
import sys
import time


class _Client(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: one request at a time, the response's body counted and dropped."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None
        self.closed = False
        self._buf = bytearray()
        self._status = 0
        self._left = -1  # body bytes left (Content-Length), -1 while in the head
        self._chunked = False
        self._close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError("connection lost"))

    def request(self, data: bytes) -> asyncio.Future[int]:
        if self.transport is None or self.closed or self.transport.is_closing():
            raise ConnectionResetError("connection closed by the server")
        self.waiter = asyncio.get_running_loop().create_future()
        self._buf.clear()
        self._left = -1
        self.transport.write(data)
        return self.waiter

    def _done(self) -> None:
        if self._close_after and self.transport is not None:
            self.transport.close()
            self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self._status)

    def data_received(self, data: bytes) -> None:
        if self._left >= 0 and not self._chunked:
            self._left -= len(data)
            if self._left <= 0:
                self._done()
            return
        self._buf += data
        if self._left < 0:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self._buf[:end]).lower()
            del self._buf[: end + 4]
            lines = head.split(b"\r\n")
            self._status = int(lines[0].split(b" ", 2)[1])
            self._chunked, length, self._close_after = False, 0, False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                value = value.strip()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value:
                    self._chunked = True
                elif name == b"connection" and value == b"close":
                    self._close_after = True
            if not self._chunked:
                self._left = length - len(self._buf)
                self._buf.clear()
                if self._left <= 0:
                    self._done()
                return
            self._left = 0
        self._chunks()

    def _chunks(self) -> None:
        buf = self._buf
        while True:
            if self._left > 0:  # inside a chunk's data (+ its CRLF)
                take = min(self._left, len(buf))
                del buf[:take]
                self._left -= take
                if self._left > 0:
                    return
            end = buf.find(b"\r\n")
            if end < 0:
                return
            size = int(bytes(buf[:end]).split(b";")[0], 16)
            if size == 0:
                if buf.find(b"\r\n\r\n", end) < 0 and buf[end + 2: end + 4] != b"\r\n":
                    return  # the last chunk's trailer is not complete yet
                buf.clear()
                self._done()
                return
            del buf[: end + 2]
            self._left = size + 2


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        total = args.total
        self.mine = [i for i in range(total) if i % args.workers == args.index]
        self.requests = {i: (f"GET /metrics HTTP/1.1\r\nHost: node-{args.name_of(i)}:{args.port}\r\n"
                             f"Authorization: Bearer {args.token}\r\nAccept: */*\r\n{args.encoding}\r\n").encode()
                         for i in self.mine}
        self.idle: collections.deque[_Client] = collections.deque()
        self.waiting: collections.deque[asyncio.Future[_Client]] = collections.deque()
        self.per_node: dict[int, _Client] = {}
        self.open = 0
        self.limit = max(1, args.pool_size // args.workers + (args.index < args.pool_size % args.workers))
        self.records: list[tuple[float, float, float, str]] = []  # (due, lag, latency, status)
        self.tasks: set[asyncio.Task[None]] = set()

    async def connect(self) -> _Client:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(_Client, self.args.host, self.args.target_port)
        return proto

    async def take(self, i: int) -> _Client:
        if self.args.mode == "per-node":
            conn = self.per_node.get(i)
            if conn is None or conn.closed:
                conn = self.per_node[i] = await self.connect()
            return conn
        while self.idle:
            conn = self.idle.popleft()
            if not conn.closed:
                return conn
            self.open -= 1
        if self.open < self.limit:
            self.open += 1
            try:
                return await self.connect()
            except BaseException:
                self.open -= 1
                raise
        fut: asyncio.Future[_Client] = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        return await fut

    def give_back(self, conn: _Client) -> None:
        if self.args.mode == "per-node":
            return
        if conn.closed:
            self.open -= 1
            if self.waiting:  # a waiter gets a fresh connection
                self.open += 1
                fut = self.waiting.popleft()
                task = asyncio.get_running_loop().create_task(self._fresh(fut))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            return
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        self.idle.append(conn)

    async def _fresh(self, fut: asyncio.Future[_Client]) -> None:
        try:
            conn = await self.connect()
        except OSError as exc:
            self.open -= 1
            if not fut.done():
                fut.set_exception(exc)
            return
        if fut.done():
            self.give_back(conn)
        else:
            fut.set_result(conn)

    async def one(self, i: int, due: float) -> None:
        conn: _Client | None = None
        status = "error"
        latency = 0.0
        sent = due
        try:
            conn = await asyncio.wait_for(self.take(i), self.args.timeout)
            sent = time.monotonic()
            code = await asyncio.wait_for(conn.request(self.requests[i]), self.args.timeout)
            latency = time.monotonic() - sent
            status = str(code)
        except TimeoutError:
            status = "timeout"
            if conn is not None and conn.transport is not None:
                conn.transport.close()
                conn.closed = True
        except OSError as exc:
            status = f"{type(exc).__name__}:{exc.errno}" if exc.errno else type(exc).__name__
        finally:
            if conn is not None:
                self.give_back(conn)
        self.records.append((due - self.args.start, sent - due, latency, status))

    async def run(self) -> None:
        args = self.args
        loop = asyncio.get_running_loop()
        period = args.total / args.rate
        # name i is due at start + i / rate + k * period
        schedule = sorted((i / args.rate, i) for i in self.mine)
        end = args.start + args.seconds
        await asyncio.sleep(max(0.0, args.start - time.monotonic()))
        cycle = 0
        while True:
            base = args.start + cycle * period
            for offset, i in schedule:
                due = base + offset
                if due >= end:
                    break
                delay = due - time.monotonic()
                if delay > 0.001:
                    await asyncio.sleep(delay)
                task = loop.create_task(self.one(i, due))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            else:
                cycle += 1
                continue
            break
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=args.timeout + 5)
        for conn in [*self.idle, *self.per_node.values()]:
            if conn.transport is not None:
                conn.transport.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--total", type=int, required=True, help="node names in all (node-<pool>-<k>)")
    p.add_argument("--per-pool", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--target-port", type=int, required=True, help="the front end's (or the exporter's) port")
    p.add_argument("--port", type=int, required=True, help="the exporter port named in the Host header")
    p.add_argument("--token", required=True)
    p.add_argument("--mode", choices=["pool", "per-node", "direct"], required=True)
    p.add_argument("--rate", type=float, required=True, help="scrapes per second of all workers together")
    p.add_argument("--pool-size", type=int, default=200)
    p.add_argument("--start", type=float, required=True, help="time.monotonic() of the first scrape")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--identity", action="store_true", help="ask for uncompressed pages (Prometheus asks for gzip)")
    args = p.parse_args(argv)
    args.encoding = "" if args.identity else "Accept-Encoding: gzip\r\n"
    per_pool = args.per_pool
    args.name_of = lambda i: f"{i // per_pool}-{i % per_pool}"
    return args


def main() -> int:
    args = parse()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    worker = Worker(args)
    try:
        import uvloop
        uvloop.run(worker.run())
    except ImportError:
        asyncio.run(worker.run())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    json.dump({"records": worker.records, "cpu": usage.ru_utime + usage.ru_stime, "pid": os.getpid()}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
