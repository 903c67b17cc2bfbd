"""Benchmark: scrape simulated GPU nodes directly and through the tunnel, in the same run.

One gateway and one agent (real processes, TLS 1.3 tunnel), N simulated dcgm-exporter
nodes with pages of --size bytes, load from wrk (Debian package ``wrk``) with C
connections. Prints requests/s, p50 and p99 latency for each mode and concurrency,
and the tunnel/direct ratios. The exporters never compress; ``--gzip on`` makes the client send
``Accept-Encoding: gzip`` (as Prometheus does), so the agent compresses before the tunnel; ``--gzip both``
runs with and without. The output says whether the client asked for gzip, and the body bytes per scrape
from the node (raw) and across the tunnel (wire), from the agent's counters. With --profile, py-spy
samples the gateway and the agent during the tunnel run and prints where their time goes.

    .venv/bin/python bench/bench_scrape.py --nodes 6 --concurrency 1 32 --duration 10

This is a benchmark, not a test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from raven.demo.launch import LocalCluster, PoolSpec, free_port
from raven.demo.simexporter import SimExporter, SimNode

LUA_ROTATE = """
local hosts = {%s}
local i = 0
request = function()
  i = i + 1
  return wrk.format("GET", "/metrics", {["Host"] = hosts[(i %% #hosts) + 1], ["Authorization"] = "Bearer %s"%s})
end
"""


@dataclass
class Result:
    mode: str
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: str
    gzip: bool = False  # the client sent Accept-Encoding: gzip
    raw_bytes: float = float("nan")  # body bytes per request from the node (tunnel runs)
    wire_bytes: float = float("nan")  # of which crossed the tunnel (after the agent's gzip)
    cpu_ms: float = float("nan")  # gateway + agent CPU per request (tunnel runs)
    gateway_ms: float = float("nan")  # of which the gateway's
    agent_ms: float = float("nan")  # of which the agents'


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    if not m:
        return float("nan")
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def parse_wrk(mode: str, concurrency: int, out: str) -> Result:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errors = []
    if m := re.search(r"Socket errors: (.*)", out):
        errors.append("socket " + m.group(1))
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors.append(f"non-2xx {m.group(1)}")
    return Result(mode, concurrency, rps, p50, p99, total, "; ".join(errors) or "none")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_wrk(url: str, concurrency: int, duration: int, script: Path | None) -> str:
    args = ["wrk", "--latency", "-t", str(min(concurrency, 2)), "-c", str(concurrency), "-d", f"{duration}s"]
    if script is not None:
        args += ["-s", str(script)]
    proc = await asyncio.create_subprocess_exec(*args, url, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed: {out.decode(errors='replace')}")
    return out.decode()


async def profile(pid: int, seconds: int, out: Path) -> asyncio.subprocess.Process | None:
    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        return None
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return await asyncio.create_subprocess_exec(
        exe, "record", "-p", str(pid), "-d", str(seconds), "-r", "200", "-f", "raw", "-o", str(out), "--nonblocking",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )


def summarize_profile(path: Path, top: int = 12) -> str:
    """Self time by function from py-spy's collapsed stacks."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return "  (no profile)"
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        leaf = stack.split(";")[-1]
        counts[re.sub(r" \(.*?/(site-packages|lib/python3\.\d+)/", " (", leaf)] += int(n)
        total += int(n)
    if not total:
        return "  (empty profile)"
    return "\n".join(f"  {n * 100 / total:5.1f}%  {fn}" for fn, n in counts.most_common(top))


async def agent_bytes(port: int) -> dict[str, float]:
    """The agent's raven_agent_bytes_total by direction."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "raven_agent_bytes_total":
                out[sample.labels["direction"]] = sample.value
    return out


async def main(args: argparse.Namespace) -> int:
    port = free_port("127.0.20.2")
    nodes = [SimNode(f"bench-{i}", f"127.0.20.{i + 1}", port, size=args.size) for i in range(1, args.nodes + 1)]
    exporter = SimExporter(nodes, serve_gzip=False)  # an exporter that never compresses
    await exporter.start()
    workdir = Path(tempfile.mkdtemp(prefix="raven-bench-"))
    # As in production: the front end checks a bearer token on every request.
    token = secrets.token_hex(32)
    cluster = LocalCluster(workdir, [PoolSpec("bench", nodes, agents=1)], allowed_ports=[port], front_token=token,
                           gateway_settings={"log_level": "warning", "front": {"server": args.front_server}},
                           agent_settings={"log_level": "warning"})
    hosts = ", ".join(f'"{n.name}:{port}"' for n in nodes)
    scripts = {False: workdir / "rotate.lua", True: workdir / "rotate-gzip.lua"}
    scripts[False].write_text(LUA_ROTATE % (hosts, token, ""))
    scripts[True].write_text(LUA_ROTATE % (hosts, token, ', ["Accept-Encoding"] = "gzip"'))
    results: list[Result] = []
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.gzip]
    runs = [(gz, c) for gz in modes for c in args.concurrency]
    try:
        await cluster.start()
        print(f"{args.nodes} nodes, {len(exporter.body(nodes[0].name))} B pages (exporter never compresses), "
              f"{args.duration}s per run, one gateway + one agent (TLS 1.3)")
        agent_port = next(iter(cluster.agents.values())).metrics_port
        for gz, c in runs:
            script = scripts[gz]
            direct = await run_wrk(f"http://{nodes[0].host}:{port}/metrics", c, args.duration, None)
            results.append(parse_wrk("direct", c, direct))
            results[-1].gzip = False
            prof_tasks = []
            if args.profile:
                assert cluster.gateway is not None
                agent = next(iter(cluster.agents.values()))
                for name, pid in (("gateway", cluster.gateway.process.pid), ("agent", agent.process.pid)):
                    out = (args.profile_dir or workdir) / f"{name}-c{c}.txt"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    p = await profile(pid, max(1, args.duration - 1), out)
                    if p is not None:
                        prof_tasks.append((name, p, out))
            assert cluster.gateway is not None
            pids = [cluster.gateway.process.pid, *(a.process.pid for a in cluster.agents.values())]
            cpu_before = [cpu_seconds(pid) for pid in pids]
            bytes_before = await agent_bytes(agent_port)
            tunnel = await run_wrk(cluster.front_url + "/metrics", c, args.duration, script)
            result = parse_wrk("tunnel", c, tunnel)
            used = [cpu_seconds(pid) - before for pid, before in zip(pids, cpu_before, strict=True)]
            bytes_after = await agent_bytes(agent_port)
            result.gzip = gz
            # wrk stops with requests in flight: their bytes are counted, so these are close, not exact.
            result.raw_bytes = (bytes_after["from_node"] - bytes_before.get("from_node", 0)) / max(1, result.requests)
            result.wire_bytes = (bytes_after["to_gateway"] - bytes_before.get("to_gateway", 0)) / max(
                1, result.requests)
            per_req = 1000 / max(1, result.requests)
            result.cpu_ms = sum(used) * per_req
            result.gateway_ms = used[0] * per_req
            result.agent_ms = sum(used[1:]) * per_req
            results.append(result)
            for name, p, path in prof_tasks:
                await p.wait()
                print(f"\nprofile of the {name} at concurrency {c} (self time, top functions):")
                print(summarize_profile(path))
    finally:
        await cluster.close()
        await exporter.close()
    print(f"\n{'mode':<7} {'gzip':>4} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'requests':>9}"
          f" {'cpu ms/req':>10} {'gateway':>8} {'agent':>8} {'raw B':>8} {'wire B':>8}  errors")
    for r in results:
        asked = "yes" if r.gzip else "no"
        print(
            f"{r.mode:<7} {asked:>4} {r.concurrency:>4} {r.rps:>9.0f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.requests:>9}"
            f" {r.cpu_ms:>10.3f} {r.gateway_ms:>8.3f} {r.agent_ms:>8.3f} {r.raw_bytes:>8.0f} {r.wire_bytes:>8.0f}"
            f"  {r.errors}"
        )
    print("\ngzip: whether the client sent Accept-Encoding: gzip (the direct runs never do; the exporter never "
          "compresses)")
    for i in range(0, len(results), 2):
        d, t = results[i], results[i + 1]
        print(f"concurrency {t.concurrency:>3}, client asked for gzip: {'yes' if t.gzip else 'no ':<3}: tunnel/direct "
              f"throughput {t.rps / d.rps:.2f}, added p50 {t.p50_ms - d.p50_ms:+.2f} ms, added p99 "
              f"{t.p99_ms - d.p99_ms:+.2f} ms, tunnel bytes {100 * t.wire_bytes / max(1.0, t.raw_bytes):.1f} % of "
              "the page")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=6, help="simulated nodes (default 6)")
    parser.add_argument("--size", type=int, default=50 * 1024, help="page size in bytes (default 51200)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="connections (default 1 32)")
    parser.add_argument("--duration", type=int, default=10, help="seconds per run (default 10)")
    parser.add_argument("--gzip", choices=["off", "on", "both"], default="both",
                        help="whether the client sends Accept-Encoding: gzip (as Prometheus does); default both")
    parser.add_argument("--front-server", choices=["lean", "aiohttp"], default="lean",
                        help="the gateway's front-port server (front.server; default lean)")
    parser.add_argument("--profile", action="store_true", help="sample gateway and agent with py-spy")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="keep py-spy's collapsed stacks here (default: a temporary folder, removed)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("bench: wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 1
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main(args))
    return int(uvloop.run(main(args)))


if __name__ == "__main__":
    sys.exit(cli())
