"""An attacker that fills an ops listener with held keep-alive connections, run as its own process.

From each source address it keeps ``per`` connections: each sends one ``GET /healthz`` (no credentials are
needed there), reads the answer and then holds the connection, sending nothing more, until the server closes
it; whatever is closed (or refused) is opened again after ``reopen`` seconds, for as long as the process runs.
With ``--slow-head`` each connection sends only the first line of that request instead, and holds it owing the
rest of its head (and counts as held as soon as it has sent it).
Every half second it prints one line, ``open=N held=N opened=N refused=N closed=N failed=N``: connections
open now (connected, not closed yet), held now (answered 200 and still open), opened in all, refused (any status
but 200), closed by the server after a 200, and connects or exchanges that failed. It stops on SIGTERM or SIGINT.

    python -m tests.support.opsflood HOST PORT --sources 127.0.30.1,127.0.30.2 --per 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from dataclasses import dataclass, fields

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: ops\r\nUser-Agent: opsflood\r\n\r\n"
PARTIAL = b"GET /healthz HTTP/1.1\r\n"
EXCHANGE_TIMEOUT = 10.0


@dataclass
class Counts:
    open: int = 0
    held: int = 0
    opened: int = 0
    refused: int = 0
    closed: int = 0
    failed: int = 0

    def line(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


async def _answer(reader: asyncio.StreamReader) -> int:
    """Read one response (head and Content-Length body); return its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    await reader.readexactly(length)
    return status


async def _slot(host: str, port: int, source: str, reopen: float, slow_head: bool, counts: Counts) -> None:
    while True:
        writer: asyncio.StreamWriter | None = None
        try:
            reader, opened = await asyncio.wait_for(
                asyncio.open_connection(host, port, local_addr=(source, 0)), EXCHANGE_TIMEOUT)
            writer = opened
            counts.opened += 1
            counts.open += 1
            opened.write(PARTIAL if slow_head else REQUEST)
            status = 200 if slow_head else await asyncio.wait_for(_answer(reader), EXCHANGE_TIMEOUT)
            if status != 200:
                counts.refused += 1
            else:
                counts.held += 1
                try:
                    while await reader.read(65536):  # hold it, sending nothing, until the server closes it
                        pass
                finally:
                    counts.held -= 1
                counts.closed += 1
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            counts.failed += 1
        finally:
            if writer is not None:
                writer.close()
                counts.open -= 1
        await asyncio.sleep(reopen)


async def run(host: str, port: int, sources: list[str], per: int, reopen: float, slow_head: bool) -> None:
    counts = Counts()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    slots = [asyncio.create_task(_slot(host, port, source, reopen, slow_head, counts))
             for source in sources for _ in range(per)]
    try:
        while not stop.is_set():
            print(counts.line(), flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        # Cancel until every slot has ended: Python 3.11's wait_for loses a cancel that lands as the exchange it
        # waits for completes, and that slot went on holding its connection until the stopper's SIGKILL (10 s).
        while pending := [task for task in slots if not task.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.5)
        await asyncio.gather(*slots, return_exceptions=True)
        print(counts.line(), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--sources", required=True, help="source addresses, comma-separated")
    parser.add_argument("--per", type=int, default=64, help="connections held from each source address")
    parser.add_argument("--reopen", type=float, default=0.02, help="seconds between a close and the next open")
    parser.add_argument("--slow-head", action="store_true", help="send only a request's first line, then hold")
    args = parser.parse_args(argv)
    asyncio.run(run(args.host, args.port, args.sources.split(","), args.per, args.reopen, args.slow_head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
