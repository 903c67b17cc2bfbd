"""Small traffic tools that the layer-3 testbed runs inside its namespaces (``ip netns exec NS python -m
tests.support.l3tools ...``): a TCP sink and source that hash what they carry, a UDP counter, and a sender of
packets with a forged source address. Each prints one JSON line at the end (the source also prints progress
lines), so that a test reads figures, not prose.

    recv --listen 10.212.0.10:5001                      # one connection: bytes, sha256, seconds
    send --to 10.212.0.10:5001 --bytes 67108864 [--rate 20e6] [--progress 4194304]
    udp-count --listen 10.212.0.10:5002 --seconds 3     # datagrams received, and from whom
    spoof --src 10.99.0.66 --to 10.212.0.10:5002 --count 20   # raw IPv4/UDP with a forged source
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import struct
import sys
import time

CHUNK = 256 * 1024


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def recv(args: argparse.Namespace) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(_addr(args.listen))
        srv.listen(1)
        srv.settimeout(args.accept_timeout)
        _say(event="listening", listen=args.listen)
        conn, peer = srv.accept()
    digest = hashlib.sha256()
    total = 0
    start = time.monotonic()
    with conn:
        conn.settimeout(args.idle_timeout)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            digest.update(view[:n])
            total += n
    _say(event="done", bytes=total, sha256=digest.hexdigest(), seconds=time.monotonic() - start, peer=peer[0])
    return 0


def send(args: argparse.Namespace) -> int:
    digest = hashlib.sha256()
    total = 0
    next_report = args.progress
    with socket.create_connection(_addr(args.to), timeout=args.connect_timeout) as conn:
        conn.settimeout(args.idle_timeout)
        start = time.monotonic()
        while total < args.bytes:
            chunk = os.urandom(min(CHUNK, args.bytes - total))  # never the same twice: a lost or repeated
            conn.sendall(chunk)  # segment cannot go unnoticed by the hash
            digest.update(chunk)
            total += len(chunk)
            if args.progress and total >= next_report:
                _say(event="progress", bytes=total, seconds=time.monotonic() - start)
                next_report += args.progress
            if args.rate:
                ahead = total / args.rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # wait for the receiver's close: everything has arrived
    _say(event="done", bytes=total, sha256=digest.hexdigest(), seconds=time.monotonic() - start)
    return 0


def udp_count(args: argparse.Namespace) -> int:
    sources: dict[str, int] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(_addr(args.listen))
        _say(event="listening", listen=args.listen)
        deadline = time.monotonic() + args.seconds
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                _, peer = s.recvfrom(65535)
            except TimeoutError:
                break
            sources[peer[0]] = sources.get(peer[0], 0) + 1
    _say(event="done", received=sum(sources.values()), sources=sources)
    return 0


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def udp_packet(src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    """A complete IPv4/UDP packet with both checksums right (IPPROTO_RAW sends it as it is, forged source
    included; the kernel only fills in the IP checksum and length again)."""
    udp_len = 8 + len(payload)
    s, d = socket.inet_aton(src), socket.inet_aton(dst)
    pseudo = s + d + struct.pack("!BBH", 0, socket.IPPROTO_UDP, udp_len)
    udp = struct.pack("!HHHH", sport, dport, udp_len, 0) + payload
    csum = _checksum(pseudo + udp) or 0xFFFF
    udp = udp[:6] + struct.pack("!H", csum) + udp[8:]
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0x5241, 0, 64, socket.IPPROTO_UDP, 0, s, d)
    header = header[:10] + struct.pack("!H", _checksum(header)) + header[12:]
    return header + udp


def spoof(args: argparse.Namespace) -> int:
    host, port = _addr(args.to)
    packet = udp_packet(args.src, host, 40000, port, b"raven-spoof-test")
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as s:
        for _ in range(args.count):
            s.sendto(packet, (host, 0))
            time.sleep(args.interval)
    _say(event="done", sent=args.count, src=args.src, to=args.to)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.l3tools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("recv")
    p.add_argument("--listen", required=True)
    p.add_argument("--accept-timeout", type=float, default=60)
    p.add_argument("--idle-timeout", type=float, default=60)
    p.set_defaults(func=recv)
    p = sub.add_parser("send")
    p.add_argument("--to", required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--rate", type=float, default=0.0, help="bytes per second (0: as fast as possible)")
    p.add_argument("--progress", type=int, default=0, help="print a progress line every this many bytes")
    p.add_argument("--connect-timeout", type=float, default=10)
    p.add_argument("--idle-timeout", type=float, default=60)
    p.set_defaults(func=send)
    p = sub.add_parser("udp-count")
    p.add_argument("--listen", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.set_defaults(func=udp_count)
    p = sub.add_parser("spoof")
    p.add_argument("--src", required=True)
    p.add_argument("--to", required=True)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.01)
    p.set_defaults(func=spoof)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
