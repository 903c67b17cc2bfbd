"""The simulated dcgm-exporter: rendering, serving and fault injection."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import logging
import signal
import socket
import sys
import time
import zlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raven.demo import simexporter, simserver
from raven.demo.launch import free_port
from raven.demo.simexporter import SimExporter, SimNode, default_nodes, gpu_util, render_metrics
from tests.support.paths import ROOT

PLAIN = {"Accept-Encoding": "identity"}
GPU_FAMILIES = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
)
PROCESS_FAMILIES = ("DCGM_CUSTOM_PROCESS_SM_UTIL", "DCGM_CUSTOM_PROCESS_MEM_USED")


@pytest.fixture(autouse=True)
def no_server_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Faults are deliberate: the exporter must not log them as server errors."""
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def families(body: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Family name -> [(labels, value)], through prometheus_client's own parser."""
    return {
        family.name: [(dict(s.labels), s.value) for s in family.samples]
        for family in text_string_to_metric_families(body.decode())
    }


# Rendering ---------------------------------------------------------------------


def test_render_parses_like_dcgm_exporter() -> None:
    body = render_metrics("edge-gpu-1")
    text = body.decode()
    parsed = families(body)
    for name in GPU_FAMILIES:
        assert f"# HELP {name} " in text and f"# TYPE {name} gauge" in text
        samples = parsed[name]
        assert sorted(labels["gpu"] for labels, _ in samples) == [str(i) for i in range(8)]
        for labels, _ in samples:
            gpu = labels["gpu"]
            assert labels["device"] == f"nvidia{gpu}"
            assert labels["modelName"] == "NVIDIA H100 80GB HBM3"
            assert labels["DCGM_FI_DRIVER_VERSION"] == "550.54.15"
            assert labels["UUID"].startswith("GPU-") and len(labels["UUID"]) == 40
            assert {"pci_bus_id", "pod", "namespace", "container"} <= labels.keys()
    assert parsed["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]  # a counter parses too
    for name in PROCESS_FAMILIES:
        samples = parsed[name]
        assert len(samples) == 8 * 4
        for labels, value in samples:
            assert {"gpu", "pid", "namespace", "pod", "container"} <= labels.keys()
            assert value >= 0
    pids = [labels["pid"] for labels, _ in parsed["DCGM_CUSTOM_PROCESS_SM_UTIL"]]
    assert len(set(pids)) == len(pids)
    # Values are plausible: memory adds up, utilization is a percentage.
    for (labels, used), (labels2, free) in zip(
        parsed["DCGM_FI_DEV_FB_USED"], parsed["DCGM_FI_DEV_FB_FREE"], strict=True
    ):
        assert labels["gpu"] == labels2["gpu"]
        assert 0 < used < 81559 and 0 < free < 81559 and used + free <= 81559
    assert all(0 <= v <= 100 for _, v in parsed["DCGM_FI_DEV_GPU_UTIL"])
    assert all(0 <= v <= 1 for _, v in parsed["DCGM_FI_PROF_GR_ENGINE_ACTIVE"])


@pytest.mark.parametrize("node", ["edge-gpu-1", "edge-gpu-42", "gpu-node-a.us-west-2.compute.internal"])
def test_default_size_is_tens_of_kib(node: str) -> None:
    body = render_metrics(node)
    assert 30 * 1024 <= len(body) <= 60 * 1024
    assert len(gzip.compress(body)) < len(body) / 5


def test_hostname_label_is_the_node() -> None:
    for node in ("edge-gpu-1", "edge-gpu-2"):
        parsed = families(render_metrics(node))
        hostnames = {labels.get("Hostname") for samples in parsed.values() for labels, _ in samples}
        assert hostnames == {node}


def test_hostname_is_escaped() -> None:
    node = 'odd"name\\x'
    parsed = families(render_metrics(node, gpus=1, processes_per_gpu=1))
    assert {labels["Hostname"] for labels, _ in parsed["DCGM_FI_DEV_GPU_UTIL"]} == {node}


def test_gpu_util() -> None:
    body = render_metrics("edge-gpu-1", gpus=12)
    parsed = {labels["gpu"]: value for labels, value in families(body)["DCGM_FI_DEV_GPU_UTIL"]}
    for gpu in ("0", "1", "10", "11"):
        assert gpu_util(body, gpu) == parsed[gpu]
    assert gpu_util(body) == parsed["0"]
    assert gpu_util(body.decode(), "1") == parsed["1"]
    assert gpu_util(body, "12") is None
    assert gpu_util(b"") is None
    assert gpu_util(b'DCGM_FI_DEV_GPU_UTIL{UUID="x",gpu="3"} 17\n', "3") == 17.0
    assert gpu_util(b'DCGM_FI_DEV_GPU_UTIL{UUID="x",gpu="3"} 17\n', "0") is None


def test_deterministic() -> None:
    node = "edge-gpu-7"
    assert render_metrics(node) == render_metrics(node)
    assert render_metrics(node) == render_metrics(node, seed=zlib.crc32(node.encode()))
    assert render_metrics(node, seed=1) == render_metrics(node, seed=1)
    assert render_metrics(node, seed=1) != render_metrics(node, seed=2)
    assert render_metrics("edge-gpu-1") != render_metrics("edge-gpu-2")
    assert render_metrics(node, tick=3) == render_metrics(node, tick=3)


def test_values_move_and_counters_grow() -> None:
    bodies = [families(render_metrics("edge-gpu-1", tick=t)) for t in range(5)]
    # The identity of the GPUs does not change from one tick to the next ...
    uuids = [[labels["UUID"] for labels, _ in b["DCGM_FI_DEV_GPU_UTIL"]] for b in bodies]
    assert all(u == uuids[0] for u in uuids)
    # ... the gauges move a little ...
    power = [[v for _, v in b["DCGM_FI_DEV_POWER_USAGE"]] for b in bodies]
    assert len({tuple(p) for p in power}) == 5
    for before, after in itertools.pairwise(power):
        assert all(abs(a - b) < 100 for a, b in zip(before, after, strict=True))
    # ... and the counters only grow.
    energy = [[v for _, v in b["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]] for b in bodies]
    for before, after in itertools.pairwise(energy):
        assert all(b > a for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("target", [80_000, 250_000, 1_000_000])
def test_target_bytes_pads_with_processes(target: int) -> None:
    body = render_metrics("edge-gpu-1", target_bytes=target)
    assert target <= len(body) < target * 1.05 + 1000
    parsed = families(body)
    assert len(parsed["DCGM_FI_DEV_GPU_UTIL"]) == 8
    assert len(parsed["DCGM_CUSTOM_PROCESS_SM_UTIL"]) > 32
    assert len(parsed["DCGM_CUSTOM_PROCESS_MEM_USED"]) == len(parsed["DCGM_CUSTOM_PROCESS_SM_UTIL"])
    assert render_metrics("edge-gpu-1", target_bytes=target) == body
    # A target below the natural size changes nothing.
    assert render_metrics("edge-gpu-1", target_bytes=1000) == render_metrics("edge-gpu-1")


def test_default_nodes() -> None:
    nodes = default_nodes(3)
    assert [(n.name, n.host, n.port) for n in nodes] == [
        ("edge-gpu-1", "127.0.0.2", 9400),
        ("edge-gpu-2", "127.0.0.3", 9400),
        ("edge-gpu-3", "127.0.0.4", 9400),
    ]
    assert default_nodes(1, first_host=10, port=19400, prefix="n")[0] == SimNode("n1", "127.0.0.10", 19400)
    with pytest.raises(ValueError):
        default_nodes(300)


def test_accepts_gzip() -> None:
    accepts = simserver._accepts_gzip
    assert accepts("gzip")
    assert accepts("gzip, deflate, br")
    assert accepts("identity;q=0.5, GZIP;q=0.8")
    assert accepts("*")
    assert not accepts("")
    assert not accepts("identity")
    assert not accepts("deflate, gzip;q=0")


# Serving -----------------------------------------------------------------------


@pytest.fixture
async def exporter() -> AsyncIterator[SimExporter]:
    """Two nodes on two loopback addresses, on free ports chosen in advance."""
    nodes = [
        SimNode("edge-gpu-1", "127.0.0.2", free_port("127.0.0.2")),
        SimNode("edge-gpu-2", "127.0.0.3", free_port("127.0.0.3")),
    ]
    exp = SimExporter(nodes, refresh=3600.0)  # the bodies do not change during a test
    await exp.start()
    try:
        yield exp
    finally:
        await exp.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        yield s


async def test_serves_each_node_on_its_own_address(exporter: SimExporter, session: aiohttp.ClientSession) -> None:
    for node in exporter.nodes:
        assert exporter.address(node.name) == (node.host, node.port)
    url1, url2 = exporter.url("edge-gpu-1"), exporter.url("edge-gpu-2")
    assert url1.startswith("http://127.0.0.2:") and url2.startswith("http://127.0.0.3:")
    for name, url in (("edge-gpu-1", url1), ("edge-gpu-2", url2)):
        async with session.get(url, headers=PLAIN) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert "Content-Encoding" not in resp.headers
            body = await resp.read()
        assert int(resp.headers["Content-Length"]) == len(body)
        assert body == exporter.body(name)
        hostnames = {labels["Hostname"] for labels, _ in families(body)["DCGM_FI_DEV_GPU_UTIL"]}
        assert hostnames == {name}
        assert gpu_util(body) is not None
    assert exporter.requests == {"edge-gpu-1": 1, "edge-gpu-2": 1}

    for _ in range(3):
        async with session.get(url2, headers=PLAIN) as resp:
            await resp.read()
    assert exporter.requests == {"edge-gpu-1": 1, "edge-gpu-2": 4}


async def test_other_paths_and_methods(exporter: SimExporter, session: aiohttp.ClientSession) -> None:
    async with session.get(exporter.url("edge-gpu-1", "/")) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        assert b'href="./metrics"' in await resp.read()
    async with session.get(exporter.url("edge-gpu-1", "/nope")) as resp:
        assert resp.status == 404
    async with session.post(exporter.url("edge-gpu-1"), data=b"x") as resp:
        assert resp.status == 405
    async with session.head(exporter.url("edge-gpu-1"), headers=PLAIN) as resp:
        assert resp.status == 200
        assert int(resp.headers["Content-Length"]) == len(exporter.body("edge-gpu-1"))
        assert await resp.read() == b""
    assert exporter.requests["edge-gpu-1"] == 4
    assert exporter.requests["edge-gpu-2"] == 0


async def test_gzip_when_asked(exporter: SimExporter, session: aiohttp.ClientSession) -> None:
    url = exporter.url("edge-gpu-1")
    async with session.get(url, headers={"Accept-Encoding": "gzip"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Encoding"] == "gzip"
        assert "Accept-Encoding" in resp.headers["Vary"]
        compressed = await resp.read()
    async with session.get(url, headers=PLAIN) as resp:
        plain = await resp.read()
    assert len(compressed) < len(plain) / 5
    assert gzip.decompress(compressed) == plain
    assert compressed == exporter.gzip_body("edge-gpu-1")
    # A client that decompresses transparently sees the plain body.
    async with aiohttp.ClientSession() as auto, auto.get(url) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        assert await resp.read() == plain


async def test_body_is_cached_then_refreshed(session: aiohttp.ClientSession) -> None:
    exp = SimExporter([SimNode("edge-gpu-1", "127.0.0.2", 0)], refresh=0.3)
    await exp.start()
    try:
        url = exp.url("edge-gpu-1")
        bodies = []
        for _ in range(3):
            async with session.get(url, headers=PLAIN) as resp:
                bodies.append(await resp.read())
        await asyncio.sleep(0.35)
        async with session.get(url, headers=PLAIN) as resp:
            later = await resp.read()
    finally:
        await exp.close()
    assert exp.address("edge-gpu-1")[1] != 0
    # Not re-rendered on every request (unless a refresh boundary fell in between).
    assert bodies[0] == bodies[1] or bodies[1] == bodies[2]
    assert later != bodies[-1]
    assert families(later)["DCGM_FI_DEV_GPU_UTIL"]


async def test_break_mode(exporter: SimExporter, session: aiohttp.ClientSession) -> None:
    exporter.set_mode("edge-gpu-1", "break")
    for headers in (PLAIN, {"Accept-Encoding": "gzip"}):
        with pytest.raises(aiohttp.ClientError):
            async with session.get(exporter.url("edge-gpu-1"), headers=headers) as resp:
                assert resp.status == 200  # the headers arrive, the body does not
                await resp.read()

    # At the byte level: the full Content-Length is promised, about half arrives.
    host, port = exporter.address("edge-gpu-1")
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n")
        received = b""
        with pytest.raises(ConnectionError):  # reset by the peer ...
            while chunk := await reader.read(65536):
                received += chunk
            raise ConnectionResetError("closed without reset")  # ... or at least closed early
    finally:
        writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
    assert length == len(exporter.body("edge-gpu-1"))
    assert len(body) < length

    # The other node is unaffected; back to "ok" works.
    async with session.get(exporter.url("edge-gpu-2"), headers=PLAIN) as resp:
        assert len(await resp.read()) == int(resp.headers["Content-Length"])
    exporter.set_mode("edge-gpu-1", "ok")
    async with session.get(exporter.url("edge-gpu-1"), headers=PLAIN) as resp:
        assert await resp.read() == exporter.body("edge-gpu-1")


async def test_stall_mode_times_out_and_close_still_finishes(session: aiohttp.ClientSession) -> None:
    exp = SimExporter([SimNode("edge-gpu-1", "127.0.0.2", 0), SimNode("edge-gpu-2", "127.0.0.3", 0)])
    await exp.start()
    try:
        exp.set_mode("edge-gpu-1", "stall")
        url = exp.url("edge-gpu-1")
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=0.5)) as resp:
                await resp.read()
        assert time.monotonic() - started < 2
        async with session.get(exp.url("edge-gpu-2"), timeout=aiohttp.ClientTimeout(total=5)) as resp:
            assert resp.status == 200

        # A client with no timeout of its own is left hanging until the exporter closes.
        hanging = asyncio.create_task(session.get(url, timeout=aiohttp.ClientTimeout(total=None)))
        await asyncio.sleep(0.3)
        assert not hanging.done()
        assert exp.requests["edge-gpu-1"] == 2
    finally:
        started = time.monotonic()
        await exp.close()
        assert time.monotonic() - started < 3
    with pytest.raises(aiohttp.ClientError):
        async with await asyncio.wait_for(hanging, 3) as resp:
            await resp.read()
    await exp.close()  # idempotent


async def test_slow_mode(session: aiohttp.ClientSession) -> None:
    exp = SimExporter([SimNode("small", "127.0.0.2", 0, gpus=1)], refresh=3600.0)
    await exp.start()
    try:
        exp.set_mode("small", "slow")
        body = exp.body("small")
        started = time.monotonic()
        async with session.get(exp.url("small"), headers=PLAIN) as resp:
            assert await resp.read() == body
        chunks = -(-len(body) // 1024)
        assert time.monotonic() - started >= (chunks - 1) * 0.05
    finally:
        await exp.close()


async def test_slow_mode_ends_on_close(session: aiohttp.ClientSession) -> None:
    exp = SimExporter([SimNode("edge-gpu-1", "127.0.0.2", 0)])
    await exp.start()
    try:
        exp.set_mode("edge-gpu-1", "slow")
        resp = await session.get(exp.url("edge-gpu-1"), headers=PLAIN)
        reading = asyncio.create_task(resp.read())
        await asyncio.sleep(0.2)
        assert not reading.done()
    finally:
        started = time.monotonic()
        await exp.close()
        assert time.monotonic() - started < 3
    with pytest.raises(aiohttp.ClientError):
        await asyncio.wait_for(reading, 3)
    resp.release()


async def test_error_mode(exporter: SimExporter, session: aiohttp.ClientSession) -> None:
    exporter.set_mode("edge-gpu-2", "error")
    async with session.get(exporter.url("edge-gpu-2")) as resp:
        assert resp.status == 500
        assert b"DCGM" in await resp.read()
    async with session.get(exporter.url("edge-gpu-1")) as resp:
        assert resp.status == 200
    exporter.set_mode("edge-gpu-2", "ok")
    async with session.get(exporter.url("edge-gpu-2")) as resp:
        assert resp.status == 200
    assert exporter.requests == {"edge-gpu-1": 1, "edge-gpu-2": 2}


async def test_refuse_mode_and_back(exporter: SimExporter, session: aiohttp.ClientSession) -> None:
    name = "edge-gpu-1"
    host, port = exporter.address(name)
    async with session.get(exporter.url(name), headers=PLAIN) as resp:  # leaves a keep-alive connection
        assert resp.status == 200
        await resp.read()

    exporter.set_mode(name, "refuse")
    assert exporter.mode(name) == "refuse"
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(host, port)
    with pytest.raises(aiohttp.ClientConnectionError):  # the pooled connection is gone too
        async with session.get(exporter.url(name), headers=PLAIN) as resp:
            await resp.read()
    async with aiohttp.ClientSession() as fresh:
        with pytest.raises(aiohttp.ClientConnectorError):
            async with fresh.get(exporter.url(name)) as resp:
                await resp.read()
    async with session.get(exporter.url("edge-gpu-2"), headers=PLAIN) as resp:
        assert resp.status == 200

    exporter.set_mode(name, "ok")
    assert exporter.address(name) == (host, port)
    async with session.get(exporter.url(name), headers=PLAIN) as resp:
        assert resp.status == 200
        assert await resp.read() == exporter.body(name)
    # Refuse again and back again: the listener can be reopened any number of times.
    exporter.set_mode(name, "refuse")
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(host, port)
    exporter.set_mode(name, "ok")
    async with session.get(exporter.url(name), headers=PLAIN) as resp:
        assert resp.status == 200


async def test_refuse_toggled_without_yielding(exporter: SimExporter) -> None:
    name = "edge-gpu-1"
    host, port = exporter.address(name)
    for mode in ("refuse", "ok", "refuse", "ok", "ok"):
        exporter.set_mode(name, mode)
    async with aiohttp.ClientSession() as s, s.get(exporter.url(name)) as resp:
        assert resp.status == 200
    exporter.set_mode(name, "refuse")
    exporter.set_mode(name, "ok")
    exporter.set_mode(name, "refuse")
    await asyncio.sleep(0.05)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(host, port)
    exporter.set_mode(name, "ok")  # and close() right after a reopen


async def test_refuse_before_start_and_close_while_refusing() -> None:
    exp = SimExporter([SimNode("edge-gpu-1", "127.0.0.2", 0), SimNode("edge-gpu-2", "127.0.0.3", 0)])
    exp.set_mode("edge-gpu-1", "refuse")
    await exp.start()
    try:
        async with aiohttp.ClientSession() as s, s.get(exp.url("edge-gpu-2")) as resp:
            assert resp.status == 200
        with pytest.raises(ValueError):
            exp.set_mode("edge-gpu-2", "bogus")  # type: ignore[arg-type]
        with pytest.raises(KeyError):
            exp.set_mode("nope", "ok")
    finally:
        await exp.close()
    await exp.close()


async def test_nodelay_is_set(exporter: SimExporter, session: aiohttp.ClientSession) -> None:
    """aiohttp sets TCP_NODELAY on every accepted connection."""
    async with session.get(exporter.url("edge-gpu-1")) as resp:
        assert resp.status == 200
        await resp.read()
    assert exporter._web is not None
    connections = exporter._web.connections  # the keep-alive connection is still open
    assert connections
    for conn in connections:
        assert conn.transport is not None
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        simexporter.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--node NAME=HOST[:PORT]" in out and "--size" in out and "--gpus" in out


def test_parse_node() -> None:
    assert simexporter._parse_node("a=127.0.0.2:19400") == SimNode("a", "127.0.0.2", 19400)
    assert simexporter._parse_node("a=127.0.0.2") == SimNode("a", "127.0.0.2", 9400)
    for bad in ("a", "=127.0.0.2", "a=127.0.0.2:x"):
        with pytest.raises(Exception, match=r"NAME=HOST|port"):
            simexporter._parse_node(bad)


@pytest.mark.integration
async def test_standalone_runs_until_signal() -> None:
    ports = [free_port("127.0.0.2"), free_port("127.0.0.3")]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "raven.demo.simexporter",
        "--node",
        f"edge-gpu-1=127.0.0.2:{ports[0]}",
        "--node",
        f"edge-gpu-2=127.0.0.3:{ports[1]}",
        "--gpus",
        "4",
        "--size",
        "100000",
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(100):
                try:
                    async with s.get(f"http://127.0.0.3:{ports[1]}/metrics") as resp:
                        body = await resp.read()
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("standalone exporter did not come up")
        assert len(body) >= 100_000
        parsed = families(body)
        assert {labels["Hostname"] for labels, _ in parsed["DCGM_FI_DEV_GPU_UTIL"]} == {"edge-gpu-2"}
        assert len(parsed["DCGM_FI_DEV_GPU_UTIL"]) == 4
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0
        log = stderr.decode()
        assert "edge-gpu-1" in log and "edge-gpu-2" in log and "shutting down" in log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
