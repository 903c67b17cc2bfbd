"""What a platform team sees: `raven status` tables and JSON, and the status page in a real (headless) browser."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from raven import __version__
from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from raven.protocol import wire
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.procs import run_to_end

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

TOKEN = "status-token-0123456789abcdef"


@dataclass
class Seen:
    cluster: LocalCluster
    port: int

    @property
    def ops(self) -> str:
        return f"http://127.0.0.1:{self.cluster.gateway_metrics_port}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def seen(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Seen]:
    port = pick_node_port(HOSTS)
    ok = [SimNode("st-a-1", HOSTS[0], port), SimNode("st-a-2", HOSTS[1], port)]
    broken = SimNode("st-b-1", HOSTS[2], port)
    exporter = SimExporter([*ok, broken])
    await exporter.start()
    exporter.set_mode("st-b-1", "refuse")  # the node's exporter is down: every scrape of it fails
    cluster = LocalCluster(tmp_path_factory.mktemp("status"),
                           [PoolSpec("pool-a", ok, agents=2), PoolSpec("pool-b", [broken], agents=1)],
                           allowed_ports=[port], front_token=TOKEN)
    try:
        await cluster.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for node in ("st-a-1", "st-a-2", "st-b-1"):
                async with http.get(f"{cluster.front_url}/metrics", headers={
                        "Host": f"{node}:{port}", **cluster.auth_headers}) as resp:
                    await resp.read()
        yield Seen(cluster, port)
    finally:
        await cluster.close()
        await exporter.close()


def _raven(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raven.cli", *args], capture_output=True, text=True, timeout=30)


async def test_raven_status_prints_pools_agents_and_failing_nodes(seen: Seen, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    out = await asyncio.to_thread(_raven, "status", "--gateway", seen.ops, "--token-file", str(token))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"gateway gw-1 (replica of 1, release {__version__}, tunnel protocol 1,2,3)" in text and "ready" in text
    for agent in ("agent-pool-a-1", "agent-pool-a-2", "agent-pool-b-1"):
        row = next(x for x in text.splitlines() if agent in x).split()
        # each agent's release and agreed protocol
        assert row[1:5] == ["tunnel", agent, __version__, str(wire.PROTOCOL_VERSION)], row
    line = next(x for x in text.splitlines() if x.startswith("st-b-1"))
    assert "pool-b" in line and "502" in line and "cannot connect to node st-b-1" in line
    # columns: NODE POOL STATE REACH AGENTS LAST
    assert next(x for x in text.splitlines() if x.startswith("st-a-1")).split()[2:6] == [
        "ok", "tunnel", "agent-pool-a-1,agent-pool-a-2", "200"]
    as_json = await asyncio.to_thread(_raven, "status", "--gateway", seen.ops, "--token-file", str(token),
                                      "-o", "json")
    snap = json.loads(as_json.stdout)
    assert [p["pool"] for p in snap["pools"]] == ["pool-a", "pool-b"]
    assert len(snap["pools"][0]["agents"]) == 2 and snap["pools"][0]["reachable"] == 2
    refused = await asyncio.to_thread(_raven, "status", "--gateway", seen.ops)
    assert refused.returncode == 1 and "--token-file" in refused.stderr


async def test_status_endpoints_need_credentials(seen: Seen) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.get(seen.ops + "/status") as resp:
            assert resp.status == 401
        async with http.get(seen.ops + "/status.html") as resp:
            assert resp.status == 401
            assert resp.headers["WWW-Authenticate"].startswith('Basic realm="raven"')  # the browser asks
        basic = "Basic " + base64.b64encode(f"me:{TOKEN}".encode()).decode()
        async with http.get(seen.ops + "/status.html", headers={"Authorization": basic}) as resp:
            assert resp.status == 200 and resp.content_type == "text/html"


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "Debian's chromium is needed (scripts/system-deps.sh installs it)"
    return exe


async def test_status_page_in_a_real_browser(seen: Seen, tmp_path: Path) -> None:
    """Headless Chromium loads the page (logging in as a browser does) and shows what a person would see."""
    url = f"http://viewer:{TOKEN}@127.0.0.1:{seen.cluster.gateway_metrics_port}/status.html"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]
    _, out, err = await run_to_end(_chromium(), *flags, "--dump-dom", url)
    dom = out.decode()
    assert "<h1>Raven gateway gw-1</h1>" in dom, err.decode()[-2000:]
    for text in ("pool-a", "pool-b", "agent-pool-a-1", "agent-pool-a-2", "agent-pool-b-1", "st-a-1", "st-a-2"):
        assert text in dom
    assert f"release {__version__}, tunnel protocol 1,2,3" in dom  # the gateway's release, and each agent's
    assert dom.count(f"{__version__}, protocol {wire.PROTOCOL_VERSION}, session") == 3
    row = dom[dom.index("<td>st-b-1</td>"):]
    row = row[: row.index("</tr>")]
    assert "cannot connect to node st-b-1" in row and "502" in row  # the failing node with its reason
    assert 'http-equiv="refresh"' in dom
    assert "http://" not in dom.split("<body>", 1)[0].replace(url, "")  # no external assets


def steady(text: bytes) -> bytes:
    return b"".join(line for line in text.splitlines(keepends=True) if not line.startswith(b"process_"))


async def test_views_are_gzipped_and_answer_304_while_nothing_changed(seen: Seen) -> None:
    """As Prometheus reads /sd (Accept-Encoding: gzip, then If-None-Match) and an operator the status."""
    import gzip as gz

    auth = seen.cluster.auth_headers
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), auto_decompress=False) as http:
        for path in (f"/sd?group=pool&port={seen.port}", "/nodes", "/hosts", "/metrics"):
            async with http.get(seen.ops + path, headers={**auth, "Accept-Encoding": "gzip"}) as resp:
                assert resp.status == 200 and resp.headers["Content-Encoding"] == "gzip", path
                body = gz.decompress(await resp.read())
                etag = resp.headers["ETag"]
            async with http.get(seen.ops + path, headers={**auth, "Accept-Encoding": "identity"}) as plain:
                again_body = await plain.read()
                assert "Content-Encoding" not in plain.headers, path
            if path == "/metrics":
                # The process collector's CPU and memory move between two reads, and so do its counters: the same
                # text but for those, and no 304 to expect.
                assert steady(again_body) == steady(body), path
                continue
            assert again_body == body, path
            async with http.get(seen.ops + path, headers={**auth, "If-None-Match": etag}) as again:
                assert again.status == 304 and again.headers["ETag"] == etag and await again.read() == b"", path
            async with http.get(seen.ops + path, headers={**auth, "If-None-Match": 'W/"other"'}) as other:
                assert other.status == 200, path
        groups = json.loads(gz.decompress(await (await http.get(
            seen.ops + f"/sd?group=pool&port={seen.port}", headers={**auth, "Accept-Encoding": "gzip"})).read()))
    # One group per pool (all connected): every node a target of it, its labels the group's.
    assert sorted((g["labels"]["pool"], sorted(g["targets"])) for g in groups) == [
        ("pool-a", [f"st-a-1:{seen.port}", f"st-a-2:{seen.port}"]), ("pool-b", [f"st-b-1:{seen.port}"])]
    assert all("node" not in g["labels"] and g["labels"]["__meta_raven_connected"] == "true" for g in groups)


async def test_status_filters_over_http_and_in_raven_status(seen: Seen, tmp_path: Path) -> None:
    auth = seen.cluster.auth_headers
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(seen.ops + "/status", params=[("state", "failing")], headers=auth) as resp:
            snap = await resp.json()
        assert [n["name"] for n in snap["nodes"]] == ["st-b-1"] and snap["matched"] == 1
        assert snap["states"]["failing"] == 1 and snap["states"]["ok"] == 2
        pool_b = next(p for p in snap["pools"] if p["pool"] == "pool-b")
        assert pool_b["failing"] == 1 and pool_b["last_error"]["node"] == "st-b-1"
        async with http.get(seen.ops + "/status", params={"pool": "pool-a", "limit": "1"}, headers=auth) as resp:
            snap = await resp.json()
        assert [n["name"] for n in snap["nodes"]] == ["st-a-1"] and snap["matched"] == 2
        async with http.get(seen.ops + "/status.html", params={"q": "a-2"}, headers=auth) as resp:
            page = await resp.text()
        assert "<td>st-a-2</td>" in page and "<td>st-a-1</td>" not in page
        async with http.get(seen.ops + "/status", params={"state": "sad"}, headers=auth) as resp:
            assert resp.status == 400 and "state must be one of" in await resp.text()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    out = await asyncio.to_thread(_raven, "status", "--gateway", seen.ops, "--token-file", str(token),
                                  "--state", "ok", "--limit", "1")
    assert out.returncode == 0, out.stderr
    nodes = [x for x in out.stdout.splitlines() if x.startswith("st-")]
    assert [x.split()[0] for x in nodes] == ["st-a-1"] and "... and 1 more (--offset 1" in out.stdout
