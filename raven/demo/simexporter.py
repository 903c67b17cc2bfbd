"""A simulated NVIDIA dcgm-exporter, for the demo, the tests and the benchmark.

``render_metrics`` produces what a real dcgm-exporter on an 8 x H100 Kubernetes node
returns: per-GPU gauges and counters labelled like the real thing, plus per-process
series. Values are deterministic for a (seed, tick) pair; the seed defaults to a CRC-32
of the node name, so a node always looks the same across runs.

``SimExporter`` serves several simulated nodes from one process, one listener per node
(``127.0.0.2:9400``, ``127.0.0.3:9400``, ... -- on Linux all of 127.0.0.0/8 is local).
Bodies are rendered once per ``refresh`` interval, together with a gzip copy, so a
request costs no rendering. Faults can be injected per node at run time with
``set_mode``: ``stall``, ``break``, ``cut``, ``slow``, ``refuse``, ``error`` and back to ``ok``.

Run standalone::

    python -m raven.demo.simexporter --node edge-gpu-1=127.0.0.2:9400 --node edge-gpu-2=127.0.0.3:9400

Why this module is long and not split: it is a self-contained simulated dcgm-exporter (series model,
server, fault modes, CLI) run as one file by the demo and the tests, a tool rather than product code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import logging
import random
import re
import signal
import socket
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Literal, get_args

from aiohttp import web

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

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
MODEL_NAME: Final = "NVIDIA H100 80GB HBM3"
DRIVER_VERSION: Final = "550.54.15"
FB_TOTAL_MIB: Final = 81559
FB_RESERVED_MIB: Final = 591
DEFAULT_PORT: Final = 9400
REFRESH_SECONDS: Final = 5.0
SLOW_CHUNK: Final = 1024
SLOW_DELAY: Final = 0.05

Mode = Literal["ok", "stall", "break", "cut", "slow", "refuse", "error"]
MODES: Final[tuple[str, ...]] = get_args(Mode)

# PCI bus ids of the eight GPUs of an HGX H100 board, in nvidia-smi order.
_HGX_BUS_IDS: Final = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

# (namespace, workload, container): what runs on the simulated GPUs.
_WORKLOADS: Final = (
    ("ml-training", "llama3-70b-finetune", "trainer"),
    ("ml-training", "ray-worker-gpu", "ray-worker"),
    ("inference", "vllm-mixtral-8x7b", "vllm"),
    ("inference", "triton-embeddings", "tritonserver"),
    ("research", "jupyter-gpu-akovacs", "notebook"),
    ("batch", "video-transcode-backfill", "worker"),
)

# Per-GPU families: (name, type, help). Values come from _Gpu.values(), same order.
# Per-GPU families: (name, type, help), a subset of dcgm-exporter's default-counters.csv
# that keeps a default 8-GPU body near 50 KiB. Values come from _Gpu.values(), same order.
_GPU_FAMILIES: Final = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active."),
    (
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
    ),
)

_PROC_SM: Final = (
    "DCGM_CUSTOM_PROCESS_SM_UTIL",
    "gauge",
    "SM utilization of a process on the GPU (in %).",
)
_PROC_MEM: Final = (
    "DCGM_CUSTOM_PROCESS_MEM_USED",
    "gauge",
    "Framebuffer memory used by a process on the GPU (in MiB).",
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _header(name: str, typ: str, help_text: str) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {typ}\n"


def _ratio(value: float) -> str:
    return f"{min(max(value, 0.0), 1.0):.6f}"


def _seed_for(node: str) -> int:
    return zlib.crc32(node.encode())


@dataclass(frozen=True, slots=True)
class _Pod:
    namespace: str
    pod: str
    container: str


class _Gpu:
    """Static identity and load profile of one simulated GPU."""

    __slots__ = (
        "energy_base",
        "index",
        "labels",
        "mem_fraction",
        "pod",
        "temp_offset",
        "tensor_ratio",
        "util_base",
        "uuid",
    )

    def __init__(self, index: int, node: str, pod: _Pod, rng: random.Random) -> None:
        self.index = index
        self.pod = pod
        self.uuid = (
            f"GPU-{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}-{rng.getrandbits(16):04x}"
            f"-{rng.getrandbits(16):04x}-{rng.getrandbits(48):012x}"
        )
        bus = _HGX_BUS_IDS[index % len(_HGX_BUS_IDS)]
        pci_bus_id = f"{index // len(_HGX_BUS_IDS):08X}:{bus:02X}:00.0"
        self.labels = (
            f'gpu="{index}",UUID="{self.uuid}",pci_bus_id="{pci_bus_id}",device="nvidia{index}",'
            f'modelName="{MODEL_NAME}",Hostname="{_escape(node)}",DCGM_FI_DRIVER_VERSION="{DRIVER_VERSION}",'
            f'container="{pod.container}",namespace="{pod.namespace}",pod="{pod.pod}"'
        )
        self.util_base = rng.uniform(35.0, 97.0)
        self.mem_fraction = rng.uniform(0.30, 0.93)
        self.tensor_ratio = rng.uniform(0.25, 0.70)
        self.temp_offset = rng.uniform(-3.0, 5.0)
        self.energy_base = rng.randrange(10**10, 10**12)

    def values(self, tick: int, rng: random.Random, interval: float) -> tuple[list[str], int, int]:
        """Formatted values for _GPU_FAMILIES at ``tick``, plus utilization and FB used."""
        util = round(min(max(self.util_base + rng.gauss(0.0, 3.0), 0.0), 100.0))
        power = min(max(75.0 + util * 5.9 + rng.gauss(0.0, 8.0), 60.0), 700.0)
        temp = round(28.0 + util * 0.42 + self.temp_offset + rng.gauss(0.0, 0.7))
        fb_used = round(FB_TOTAL_MIB * self.mem_fraction + rng.gauss(0.0, 40.0))
        fb_free = FB_TOTAL_MIB - FB_RESERVED_MIB - fb_used
        seconds = max(tick, 0) * interval
        energy = self.energy_base + round(seconds * 1000.0 * (75.0 + self.util_base * 5.9))
        gr_active = util / 100.0 * rng.uniform(0.92, 1.0)
        values = [
            "1980" if util > 3 else "345",
            "2619",
            str(temp + 6),
            str(temp),
            f"{power:.6f}",
            str(energy),
            str(util),
            str(round(util * rng.uniform(0.35, 0.65))),
            "0",
            str(fb_free),
            str(fb_used),
            _ratio(gr_active),
            _ratio(gr_active * self.tensor_ratio * rng.uniform(0.9, 1.1)),
            _ratio(gr_active * rng.uniform(0.25, 0.6)),
        ]
        return values, util, fb_used


class _Proc:
    """One simulated GPU process: a line prefix per family and a weight."""

    __slots__ = ("gpu", "min_bytes", "prefix_mem", "prefix_sm", "weight")

    def __init__(self, gpu: _Gpu, pid: int, pod: _Pod, node: str, weight: float) -> None:
        self.gpu = gpu.index
        self.weight = weight
        labels = (
            f'gpu="{gpu.index}",UUID="{gpu.uuid}",pid="{pid}",namespace="{pod.namespace}",'
            f'pod="{pod.pod}",container="{pod.container}",Hostname="{_escape(node)}"'
        )
        self.prefix_sm = f"{_PROC_SM[0]}{{{labels}}} "
        self.prefix_mem = f"{_PROC_MEM[0]}{{{labels}}} "
        # Both lines with one-digit values: a lower bound on what this process adds.
        self.min_bytes = len(self.prefix_sm.encode()) + len(self.prefix_mem.encode()) + 4


class _NodeModel:
    """Everything static about one simulated node; ``render(tick)`` produces a body."""

    def __init__(
        self,
        node: str,
        gpus: int = 8,
        processes_per_gpu: int = 4,
        seed: int | None = None,
        target_bytes: int | None = None,
        interval: float = REFRESH_SECONDS,
    ) -> None:
        if gpus < 1:
            raise ValueError("gpus must be at least 1")
        if processes_per_gpu < 0:
            raise ValueError("processes_per_gpu must not be negative")
        self.node = node
        self.seed = _seed_for(node) if seed is None else seed
        self.target_bytes = target_bytes
        self.interval = interval
        self._rng = random.Random(self.seed)
        rng = self._rng
        self._pods = [self._make_pod(rng) for _ in range(max(2, gpus // 2))]
        self.gpus = [_Gpu(i, node, self._pods[i % len(self._pods)], rng) for i in range(gpus)]
        self._pid = rng.randrange(2000, 60000)
        self.procs: list[_Proc] = []
        for _ in range(gpus * processes_per_gpu):
            self._add_proc()
        self._prefixes = [[f"{name}{{{gpu.labels}}} " for gpu in self.gpus] for name, _, _ in _GPU_FAMILIES]
        self._headers = [_header(*family) for family in _GPU_FAMILIES]
        self._proc_headers = (_header(*_PROC_SM), _header(*_PROC_MEM))

    @staticmethod
    def _make_pod(rng: random.Random) -> _Pod:
        namespace, workload, container = rng.choice(_WORKLOADS)
        alphabet = "bcdfghjklmnpqrstvwxz2456789"
        replicaset = "".join(rng.choice(alphabet) for _ in range(10))
        suffix = "".join(rng.choice(alphabet) for _ in range(5))
        return _Pod(namespace, f"{workload}-{replicaset}-{suffix}", container)

    def _add_proc(self) -> _Proc:
        rng = self._rng
        gpu = self.gpus[len(self.procs) % len(self.gpus)]
        # Most processes on a GPU belong to the pod that holds it (data-loader workers,
        # MPS clients); some come from elsewhere (time-sliced sharing).
        pod = gpu.pod if rng.random() < 0.75 else rng.choice(self._pods)
        self._pid += rng.randrange(3, 400)
        first = len(self.procs) < len(self.gpus)  # the pod's main process on this GPU
        weight = rng.uniform(2.0, 4.0) if first else rng.uniform(0.2, 1.0)
        proc = _Proc(gpu, self._pid, pod, self.node, weight)
        self.procs.append(proc)
        return proc

    def render(self, tick: int = 0) -> bytes:
        rng = random.Random(self.seed * 1_000_003 + tick)
        utils: list[int] = []
        fb_used: list[int] = []
        columns: list[list[str]] = []
        for gpu in self.gpus:
            values, util, used = gpu.values(tick, rng, self.interval)
            columns.append(values)
            utils.append(util)
            fb_used.append(used)
        parts: list[str] = []
        for f, header in enumerate(self._headers):
            parts.append(header)
            prefixes = self._prefixes[f]
            for g, prefix in enumerate(prefixes):
                parts.append(f"{prefix}{columns[g][f]}\n")
        head = "".join(parts).encode()

        if self.target_bytes is not None:
            size = len(head) + sum(len(h) for h in self._proc_headers)
            size += sum(p.min_bytes for p in self.procs)
            while size < self.target_bytes:
                size += self._add_proc().min_bytes

        weights = [0.0] * len(self.gpus)
        for proc in self.procs:
            weights[proc.gpu] += proc.weight
        sm_lines: list[str] = [self._proc_headers[0]]
        mem_lines: list[str] = [self._proc_headers[1]]
        for proc in self.procs:
            share = proc.weight / weights[proc.gpu]
            sm_lines.append(f"{proc.prefix_sm}{round(utils[proc.gpu] * share)}\n")
            mem = round((fb_used[proc.gpu] - 520) * share * rng.uniform(0.98, 1.0))
            mem_lines.append(f"{proc.prefix_mem}{max(mem, 1)}\n")
        return head + "".join(sm_lines).encode() + "".join(mem_lines).encode()


def render_metrics(
    node: str,
    gpus: int = 8,
    processes_per_gpu: int = 4,
    seed: int | None = None,
    target_bytes: int | None = None,
    *,
    tick: int = 0,
) -> bytes:
    """A dcgm-exporter body for ``node`` in the Prometheus text format (version 0.0.4).

    Deterministic for (node, gpus, processes_per_gpu, seed, target_bytes, tick); ``seed``
    defaults to ``zlib.crc32(node)``. ``tick`` counts refresh intervals: gauges move a
    little from one tick to the next and counters only grow. With ``target_bytes`` more
    per-process series are added until the body is at least that long.
    """
    return _NodeModel(node, gpus, processes_per_gpu, seed, target_bytes).render(tick)


_GPU_UTIL_LINE = re.compile(rb"^DCGM_FI_DEV_GPU_UTIL\{([^}]*)\}[ \t]+(\S+)", re.MULTILINE)


def gpu_util(body: bytes | str, gpu: str = "0") -> float | None:
    """DCGM_FI_DEV_GPU_UTIL of GPU ``gpu`` in a scraped body, or None if absent."""
    data = body.encode() if isinstance(body, str) else body
    wanted = re.compile(rb'(?:^|,)gpu="' + re.escape(gpu.encode()) + rb'"(?:,|$)')
    for match in _GPU_UTIL_LINE.finditer(data):
        if wanted.search(match.group(1)):
            try:
                return float(match.group(2))
            except ValueError:
                return None
    return None


@dataclass
class SimNode:
    """One simulated node: its name (the Hostname label) and where it listens."""

    name: str
    host: str
    port: int = DEFAULT_PORT
    gpus: int = 8
    size: int | None = None


def default_nodes(
    count: int, first_host: int = 2, port: int = DEFAULT_PORT, prefix: str = "edge-gpu-"
) -> list[SimNode]:
    """``edge-gpu-1`` on 127.0.0.2, ``edge-gpu-2`` on 127.0.0.3, ... all on ``port``."""
    if count < 0 or first_host < 1 or first_host + count - 1 > 254:
        raise ValueError("loopback hosts must stay within 127.0.0.1 .. 127.0.0.254")
    return [SimNode(f"{prefix}{i + 1}", f"127.0.0.{first_host + i}", port) for i in range(count)]


_HTML: Final = (
    b"<html>\n<head><title>GPU Exporter</title></head>\n<body>\n<h1>GPU Exporter</h1>\n"
    b'<p><a href="./metrics">Metrics</a></p>\n</body>\n</html>\n'
)
_ERROR_BODY: Final = b"simulated dcgm-exporter failure: DCGM is not responding\n"


@lru_cache(maxsize=256)
def _accepts_gzip(accept_encoding: str) -> bool:
    for part in accept_encoding.split(","):
        token, _, params = part.partition(";")
        if token.strip().lower() not in ("gzip", "x-gzip", "*"):
            continue
        quality = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if quality > 0:
            return True
    return False


class _NodeState:
    """Run-time state of one served node."""

    def __init__(self, node: SimNode, processes_per_gpu: int, interval: float, gzip_level: int) -> None:
        self.node = node
        self.model = _NodeModel(node.name, node.gpus, processes_per_gpu, target_bytes=node.size, interval=interval)
        self.interval = interval
        self.gzip_level = gzip_level
        self.mode: Mode = "ok"
        self.address: tuple[str, int] = (node.host, node.port)
        self.server: asyncio.Server | None = None
        self.opening: asyncio.Task[None] | None = None  # re-listening after "refuse"
        self.tick: int | None = None
        self.started = 0.0
        self.plain = b""
        self.gzipped = b""
        self.plain_headers = {"Content-Type": CONTENT_TYPE, "Vary": "Accept-Encoding"}
        self.gzip_headers = {**self.plain_headers, "Content-Encoding": "gzip"}

    def bodies(self) -> tuple[bytes, bytes]:
        """(plain, gzip) bodies for now; rendered at most once per interval."""
        now = time.monotonic()
        if self.tick is None:
            self.started = now
        tick = int((now - self.started) // self.interval)
        if tick != self.tick:
            self.plain = self.model.render(tick)
            self.gzipped = gzip.compress(self.plain, compresslevel=self.gzip_level, mtime=0)
            self.tick = tick
        return self.plain, self.gzipped


class SimExporter:
    """Serves simulated dcgm-exporters, one listener per node, with fault injection.

    ``requests[name]`` counts every HTTP request a node received (any path, any mode).
    Faults set with ``set_mode`` apply to ``/metrics``, except ``refuse`` which closes
    the node's listener (and its open connections) altogether.
    """

    def __init__(
        self,
        nodes: Sequence[SimNode],
        *,
        processes_per_gpu: int = 4,
        refresh: float = REFRESH_SECONDS,
        gzip_level: int = 6,
        serve_gzip: bool = True,
    ) -> None:
        names = [node.name for node in nodes]
        self.serve_gzip = serve_gzip  # False: always the plain body, as an exporter that never compresses
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        self._states = {node.name: _NodeState(node, processes_per_gpu, refresh, gzip_level) for node in nodes}
        self._by_address: dict[tuple[str, int], _NodeState] = {}
        self.requests: dict[str, int] = dict.fromkeys(names, 0)
        self._web: web.Server | None = None
        self._closing = asyncio.Event()
        self._started = False
        self._closed = False
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def nodes(self) -> list[SimNode]:
        return [state.node for state in self._states.values()]

    def address(self, name: str) -> tuple[str, int]:
        """Where node ``name`` listens (the real port once started, even if configured as 0)."""
        return self._states[name].address

    def url(self, name: str, path: str = "/metrics") -> str:
        host, port = self.address(name)
        return f"http://{host}:{port}{path}"

    def mode(self, name: str) -> Mode:
        return self._states[name].mode

    def body(self, name: str) -> bytes:
        """The plain body node ``name`` serves right now."""
        return self._states[name].bodies()[0]

    def gzip_body(self, name: str) -> bytes:
        """The gzip body node ``name`` serves right now to clients that accept gzip."""
        return self._states[name].bodies()[1]

    async def start(self) -> None:
        if self._started or self._closed:
            raise RuntimeError("SimExporter can only be started once")
        self._started = True
        self._web = web.Server(self._handle, access_log=None, handler_cancellation=False)
        try:
            for state in self._states.values():
                state.bodies()
                if state.mode != "refuse":
                    await self._listen(state)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop listening, end stalled and slow responses, close every connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        for state in self._states.values():
            self._unlisten(state)
        if self._pending:  # listeners being reopened: they close themselves once open
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._web is not None:
            self._web.pre_shutdown()
            await self._web.shutdown(2.0)
        self._by_address.clear()

    async def __aenter__(self) -> SimExporter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def set_mode(self, name: str, mode: Mode) -> None:
        """Switch node ``name`` to ``mode``; takes effect for the next request.

        ``refuse`` closes the listener at once (connect() fails from now on) and closes
        the node's open connections; leaving ``refuse`` binds the listening socket again
        at once, so connections queue in the backlog until accept() resumes (call it from
        the event loop's thread). Only a "refuse" in the same loop iteration as the "ok"
        before it can be late: the listener then closes as soon as it has started.
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        state = self._states[name]
        previous, state.mode = state.mode, mode
        if not self._started or self._closed or previous == mode:
            return
        if mode == "refuse":
            self._unlisten(state)
            if self._web is not None:
                for conn in self._web.connections:
                    transport = conn.transport
                    if transport is not None and self._sockname(transport) == state.address:
                        conn.force_close()
        elif previous == "refuse" and state.opening is None:
            sock = self._bind(state)
            task = asyncio.get_running_loop().create_task(self._serve(state, sock))
            state.opening = task
            self._pending.add(task)
            task.add_done_callback(self._reopened)
        log.info("%s: mode %s -> %s", name, previous, mode)

    # Listeners -------------------------------------------------------------------

    @staticmethod
    def _sockname(transport: asyncio.BaseTransport) -> tuple[str, int] | None:
        sockname = transport.get_extra_info("sockname")
        if isinstance(sockname, tuple) and len(sockname) >= 2:
            return (str(sockname[0]), int(sockname[1]))
        return None

    def _bind(self, state: _NodeState) -> socket.socket:
        host, port = state.address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        bound = sock.getsockname()
        state.address = (str(bound[0]), int(bound[1]))
        self._by_address[state.address] = state
        return sock

    async def _serve(self, state: _NodeState, sock: socket.socket) -> None:
        """Accept on ``sock``; never cancelled, so the socket always ends up owned or closed."""
        assert self._web is not None
        try:
            server = await asyncio.get_running_loop().create_server(self._web, sock=sock, backlog=1024)
        except BaseException:
            sock.close()
            raise
        finally:
            state.opening = None
        if state.mode == "refuse" or self._closed:
            server.close()  # refused again, or closed, while the listener was starting
            return
        state.server = server

    def _reopened(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("reopening a listener failed: %r", exc)

    async def _listen(self, state: _NodeState) -> None:
        await self._serve(state, self._bind(state))
        log.info("%s: serving http://%s:%d/metrics", state.node.name, *state.address)

    def _unlisten(self, state: _NodeState) -> None:
        if state.server is not None:
            state.server.close()
            state.server = None

    # Requests --------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        transport = request.transport
        address = self._sockname(transport) if transport is not None else None
        state = self._by_address.get(address) if address is not None else None
        if state is None:
            raise web.HTTPNotFound()
        self.requests[state.node.name] += 1
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        mode = state.mode
        if mode == "refuse":
            if transport is not None:
                transport.abort()
            return web.Response(status=503)
        path = request.path
        if path == "/":
            return web.Response(body=_HTML, content_type="text/html")
        if path != "/metrics":
            raise web.HTTPNotFound()

        plain, gzipped = state.bodies()
        use_gzip = self.serve_gzip and _accepts_gzip(request.headers.get("Accept-Encoding", ""))
        body = gzipped if use_gzip else plain
        headers = state.gzip_headers if use_gzip else state.plain_headers
        if mode == "ok" or (request.method == "HEAD" and mode in ("break", "cut", "slow")):
            return web.Response(body=body, headers=headers)
        if mode == "error":
            return web.Response(status=500, body=_ERROR_BODY, content_type="text/plain")
        if mode == "stall":
            await self._stall(request)
            return web.Response(status=503)
        if mode in ("break", "cut"):  # cut: the head alone, not one body byte
            return await self._break(request, body, headers, len(body) // 2 if mode == "break" else 0)
        return await self._slow(request, body, headers)

    async def _stall(self, request: web.BaseRequest) -> None:
        """Never answer: wait until the exporter closes (or the client goes away)."""
        while not self._closing.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), 0.25)
        transport = request.transport
        if transport is not None:
            transport.abort()

    async def _break(
        self, request: web.BaseRequest, body: bytes, headers: dict[str, str], keep: int
    ) -> web.StreamResponse:
        """Full Content-Length, the first ``keep`` bytes of the body, then a reset connection."""
        response = web.StreamResponse(headers=headers)
        response.content_length = len(body)
        with contextlib.suppress(ConnectionError):
            await response.prepare(request)
            if keep:
                await response.write(body[:keep])
            transport = request.transport
            # Let what was written leave before the reset, or abort() would discard it.
            for _ in range(100):
                if transport is None or transport.get_write_buffer_size() == 0:
                    break
                await asyncio.sleep(0.01)
            if keep:
                # and give the client a moment to read it: a reset that overtakes unread data
                # makes many clients (aiohttp among them) drop that data.
                await asyncio.sleep(0.2)
            if transport is not None:
                transport.abort()
        return response

    async def _slow(self, request: web.BaseRequest, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
        """The whole body, SLOW_CHUNK bytes every SLOW_DELAY seconds."""
        response = web.StreamResponse(headers=headers)
        response.content_length = len(body)
        try:
            await response.prepare(request)
            for start in range(0, len(body), SLOW_CHUNK):
                if self._closing.is_set():
                    transport = request.transport
                    if transport is not None:
                        transport.abort()
                    break
                await response.write(body[start : start + SLOW_CHUNK])
                await asyncio.sleep(SLOW_DELAY)
        except ConnectionError:
            pass
        return response


# Standalone ----------------------------------------------------------------------


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
