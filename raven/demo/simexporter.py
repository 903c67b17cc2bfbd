"""A simulated NVIDIA dcgm-exporter, for the demo, the tests and the benchmark: the command, and its public names.

The pages are raven/demo/dcgm_page.py (``render_metrics``: the series of an 8 x H100 Kubernetes node), the HTTP
server with its fault modes raven/demo/simserver.py (``SimExporter``); both are re-exported here, where the
demo, the tests and the benchmarks import them from.

Run standalone::

    python -m raven.demo.simexporter --node edge-gpu-1=127.0.0.2:9400 --node edge-gpu-2=127.0.0.3:9400
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Sequence

from raven.demo.dcgm_page import CONTENT_TYPE, DRIVER_VERSION, MODEL_NAME, REFRESH_SECONDS, gpu_util, render_metrics
from raven.demo.simserver import DEFAULT_PORT, MODES, Mode, SimExporter, SimNode, default_nodes

__all__ = [
    "CONTENT_TYPE",
    "DRIVER_VERSION",
    "MODEL_NAME",
    "MODES",
    "Mode",
    "SimExporter",
    "SimNode",
    "default_nodes",
    "gpu_util",
    "main",
    "render_metrics",
]

log = logging.getLogger("raven.simexporter")


def _parse_node(spec: str) -> SimNode:
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        raise argparse.ArgumentTypeError(f"expected NAME=HOST[:PORT], got {spec!r}")
    host, colon, port = where.rpartition(":")
    if not colon:
        return SimNode(name, where)
    try:
        return SimNode(name, host.strip("[]"), int(port))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in {spec!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m raven.demo.simexporter",
        description=(
            "Simulated NVIDIA dcgm-exporter: serves realistic GPU metrics for several fake nodes, "
            "one listener per node, at /metrics (gzip if asked). Runs until SIGINT or SIGTERM."
        ),
        epilog=(
            "example: python -m raven.demo.simexporter --node edge-gpu-1=127.0.0.2:9400 "
            "--node edge-gpu-2=127.0.0.3:9400  (all of 127.0.0.0/8 is local on Linux)"
        ),
    )
    parser.add_argument(
        "--node",
        action="append",
        type=_parse_node,
        default=[],
        metavar="NAME=HOST[:PORT]",
        help=f"a node to simulate (repeatable); NAME is the Hostname label, PORT defaults to {DEFAULT_PORT}",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=0,
        metavar="N",
        help="also simulate N nodes edge-gpu-1.. on 127.0.0.2.. (default: 2 if no --node given)",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port for --nodes (default %(default)s)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node (default %(default)s)")
    parser.add_argument("--size", type=int, default=None, metavar="BYTES", help="pad each body to at least BYTES bytes")
    parser.add_argument(
        "--refresh",
        type=float,
        default=REFRESH_SECONDS,
        help="seconds between value updates (default %(default)s)",
    )
    parser.add_argument("--stats-interval", type=float, default=10.0, help="seconds between request-count log lines")
    parser.add_argument("--no-gzip", action="store_true",
                        help="never compress, whatever the client accepts (an exporter without gzip)")
    return parser


async def _run(nodes: Sequence[SimNode], refresh: float, stats_interval: float, serve_gzip: bool = True) -> None:
    exporter = SimExporter(nodes, refresh=refresh, serve_gzip=serve_gzip)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await exporter.start()
    try:
        for node in nodes:
            plain, gzipped = exporter.body(node.name), exporter.gzip_body(node.name)
            log.info(
                "%s: %d GPUs, body %.1f KiB (gzip %.1f KiB) at %s",
                node.name,
                node.gpus,
                len(plain) / 1024,
                len(gzipped) / 1024,
                exporter.url(node.name),
            )
        seen = dict(exporter.requests)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), stats_interval)
            for name, count in exporter.requests.items():
                if count != seen[name]:
                    log.info("%s: %d requests (+%d)", name, count, count - seen[name])
            seen = dict(exporter.requests)
    finally:
        log.info("shutting down")
        await exporter.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    nodes: list[SimNode] = list(args.node)
    count = args.nodes or (0 if nodes else 2)
    nodes += default_nodes(count, port=args.port)
    for node in nodes:
        node.gpus = args.gpus
        node.size = args.size
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_run(nodes, args.refresh, args.stats_interval, not args.no_gzip))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
