"""What a simulated NVIDIA dcgm-exporter page contains: the series model and its rendering.

``render_metrics`` produces what a real dcgm-exporter on an 8 x H100 Kubernetes node
returns: per-GPU gauges and counters labelled like the real thing, plus per-process
series. Values are deterministic for a (seed, tick) pair; the seed defaults to a CRC-32
of the node name, so a node always looks the same across runs. :class:`NodeModel` keeps
what is static about one node so that each refresh renders quickly; ``gpu_util`` reads
one value back out of a scraped page.

No I/O here: the HTTP server around it is raven/demo/simserver.py, the command raven/demo/simexporter.py.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Final

__all__ = ["CONTENT_TYPE", "DRIVER_VERSION", "MODEL_NAME", "REFRESH_SECONDS", "NodeModel", "gpu_util",
           "render_metrics"]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
MODEL_NAME: Final = "NVIDIA H100 80GB HBM3"
DRIVER_VERSION: Final = "550.54.15"
FB_TOTAL_MIB: Final = 81559
FB_RESERVED_MIB: Final = 591
REFRESH_SECONDS: Final = 5.0

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


class NodeModel:
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
    return NodeModel(node, gpus, processes_per_gpu, seed, target_bytes).render(tick)


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
