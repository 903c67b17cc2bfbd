"""Delay every packet of a link by a fixed time, in user space: the testbed's stand-in for ``tc netem delay``
on kernels built without sch_netem (this machine's is one).

    ip netns exec rv-a-gw python -m tests.support.linkdelay --queue 0 --delay-ms 75

Netfilter hands each packet that an nftables rule sends to ``queue num N`` to this process (its metadata
only: nothing is copied); the packet waits in the kernel until this process gives its verdict, ``delay``
later, and then goes on unchanged. Order is kept (one fixed delay). The rules use ``bypass``: without this
process the packets pass undelayed. deploy/testbed/topology.sh (``shape``) writes the rules, loss (nftables'
``numgen``) and rate (``tbf``) stay in the kernel.

The netlink messages are nfnetlink_queue's (linux/netfilter/nfnetlink_queue.h), built with ``struct``: a
bind, a copy mode, a queue length, then a verdict per packet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import signal
import socket
import struct
import sys

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
QUEUE_MAXLEN = 8192  # packets held at once: a 200 ms delay at ~40,000 packets/s


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(msg: int, queue: int, attrs: bytes, seq: int = 0) -> bytes:
    nfgen = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue))
    body = nfgen + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, NLM_F_REQUEST, seq, 0) + body


def bind_messages(queue: int) -> list[bytes]:
    return [
        _message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0)), 1),
        _message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)), 2),
        _message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)), 3),
    ]


def verdict(queue: int, packet_id: int) -> bytes:
    return _message(NFQNL_MSG_VERDICT, queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)))


def packet_ids(data: bytes) -> list[int]:
    """The ids of the queued packets in one read from the socket (several netlink messages may come at once)."""
    ids = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16 or offset + length > len(data):
            break
        if kind == NLMSG_ERROR:
            code = struct.unpack_from("=i", data, offset + 16)[0]
            if code:
                raise OSError(-code, f"nfnetlink_queue: {errno.errorcode.get(-code, -code)}")
        elif kind & 0xFF == NFQNL_MSG_PACKET:
            pos = offset + 20  # past nlmsghdr and nfgenmsg
            end = offset + length
            while pos + 4 <= end:
                alen, akind = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                if akind & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                pos += (alen + 3) & ~3
        offset += (length + 3) & ~3
    return ids


async def run(queue: int, delay: float) -> None:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind((0, 0))
        for message in bind_messages(queue):
            sock.send(message)
        sock.setblocking(False)

        def release(packet_id: int) -> None:
            with contextlib.suppress(OSError):  # the queue went away (the namespace is being torn down)
                sock.send(verdict(queue, packet_id))

        def readable() -> None:
            while True:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    return
                except OSError as exc:  # ENOBUFS: the kernel dropped messages (their packets pass by timeout)
                    print(f"linkdelay: {exc}", file=sys.stderr, flush=True)
                    return
                due = loop.time() + delay
                for packet_id in packet_ids(data):
                    loop.call_at(due, release, packet_id)

        loop.add_reader(sock.fileno(), readable)
        print(f"linkdelay: queue {queue}, {delay * 1000:.0f} ms", flush=True)
        await stop.wait()
        loop.remove_reader(sock.fileno())
    finally:
        sock.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.linkdelay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queue", type=int, default=0, help="nfqueue number the rules send packets to")
    parser.add_argument("--delay-ms", type=float, required=True, help="added to every packet, each way")
    args = parser.parse_args()
    if not 0 <= args.queue <= 65535 or not 0 <= args.delay_ms <= 10_000:
        parser.error("queue 0-65535, delay 0-10000 ms")
    asyncio.run(run(args.queue, args.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
