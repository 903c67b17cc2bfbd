"""Benchmark: Raven beside a C relay (nginx) and a Go relay (caddy), same page, same client, one run.

One origin, nginx (one worker), serves the same ~50 KiB dcgm-exporter page (raven/demo/dcgm_page.py, 8 GPUs)
to every path. Each path is two relay processes with TLS 1.3 and certificates checked both ways between them:

- ``nginx``: nginx -> TLS 1.3 (mutual) -> nginx -> origin; one worker each, keep-alive pools on both hops.
- ``caddy``: Debian's caddy -> one HTTP/2 connection over mutual TLS 1.3 -> caddy -> origin; GOMAXPROCS=1.
- ``raven``: gateway -> tunnel (mutual TLS 1.3, WebSocket) -> agent -> origin, the bearer token checked on
  every request; one row per build (``compiled``: what is installed; ``pure``: the same code with
  RAVEN_BUILD=pure, the interpreted modules; see README "Compiled and pure builds"). ``raven-aiohttp``: the
  installed build with aiohttp's server on the front port (``front.server: aiohttp``), the lean one's baseline.

The client is ``hey`` (Debian package), sending the bearer token and not asking for gzip (so every relay
carries the whole page); req/s counts 200 answers only. Raven's gateway lets the one client hold 32 requests
to the one node at once here (``front.client_share: 1.0``; by default a client address holds a quarter of a
node's 64). For each path: req/s and p50/p99 at 32 and at 1 connections, then CPU per scrape
of the relay's own processes (both hops, from /proc; not the origin's, not hey's) at a paced --rate scrapes/s
(8 workers), and the ratios of Raven to each peer. Missing Debian packages (nginx, caddy, hey) are installed
with apt-get. Loopback only; every process and the temporary folder are removed on every path out.

    PYTHONPATH=. .venv/bin/python bench/bench_peers.py --duration 8

This is a benchmark, not a test: its figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from raven.demo.dcgm_page import render_metrics
from raven.demo.launch import LocalCluster, PoolSpec, free_port
from raven.demo.simserver import SimNode
from raven.errors import RavenError
from raven.pki import authority

NODE = "peer-node"  # the node name Raven routes by; the other relays ignore the Host header
PACED_WORKERS = 8


@dataclass
class Row:
    path: str
    c32_rps: float = float("nan")
    c32_p50: float = float("nan")
    c32_p99: float = float("nan")
    c1_rps: float = float("nan")
    c1_p50: float = float("nan")
    c1_p99: float = float("nan")
    paced_rps: float = float("nan")
    cpu_ms: float = float("nan")  # CPU per scrape of the relay's processes, at the paced rate
    errors: list[str] = field(default_factory=list)


@dataclass
class Hey:
    rps: float
    p50_ms: float
    p99_ms: float
    ok: int
    errors: str


def ensure_packages() -> None:
    missing = [pkg for pkg, exe in (("nginx", "nginx"), ("caddy", "caddy"), ("hey", "hey")) if not shutil.which(exe)]
    if missing:
        print(f"installing from Debian: {' '.join(missing)}", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "-y", "-q", "install", *missing], check=True, env=env, stdout=subprocess.DEVNULL)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes and their children so far (Linux /proc)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def with_children(pids: list[int]) -> list[int]:
    out = list(pids)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid in pids:
                    out.append(int(entry.name))
    return out


def parse_hey(out: str) -> Hey:
    def num(pattern: str) -> float:
        m = re.search(pattern, out)
        return float(m.group(1)) if m else float("nan")

    ok = sum(int(n) for n in re.findall(r"\[200\]\s+(\d+) responses", out))
    bad = re.findall(r"\[(?!200\])(\d+)\]\s+(\d+) responses", out)
    errs = [f"{n} x HTTP {code}" for code, n in bad]
    if "Error distribution:" in out:
        errs.append(out.split("Error distribution:", 1)[1].strip().splitlines()[0])
    total = num(r"Total:\s+([\d.]+) secs")
    return Hey(ok / total if total > 0 else float("nan"), num(r"50% in ([\d.]+) secs") * 1000,
               num(r"99% in ([\d.]+) secs") * 1000, ok, "; ".join(errs))


async def hey(url: str, headers: list[str], conc: int, seconds: int, qps: float = 0.0) -> Hey:
    args = ["hey", "-disable-compression", "-c", str(conc), "-z", f"{seconds}s", "-t", "10"]
    for h in headers:
        args += ["-H", h]
    if qps:
        args += ["-q", f"{qps:.3f}"]
    proc = await asyncio.create_subprocess_exec(*args, "-host", f"{NODE}:{ORIGIN_PORT}", url,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), seconds + 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return parse_hey(out.decode(errors="replace"))


ORIGIN_PORT = 0  # set in main(): hey's Host header names the node and the origin's port, as Prometheus would


def nginx_conf(work: Path, name: str, server: str, upstream: str, location: str) -> Path:
    tmp = work / f"{name}-tmp"
    tmp.mkdir()
    user = "user root;" if os.geteuid() == 0 else ""
    path = work / f"{name}.conf"
    path.write_text(f"""{user}
worker_processes 1;
daemon off;
pid {work}/{name}.pid;
error_log {work}/{name}-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fcgi;
    uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
    keepalive_requests 100000000;
    keepalive_timeout 120s;
    {upstream}
    server {{
        {server}
        location / {{ {location} }}
    }}
}}
""")
    return path


def proxy_to(name: str, tls: str = "") -> str:
    scheme = "https" if tls else "http"
    return (f"proxy_pass {scheme}://{name}; proxy_http_version 1.1; proxy_set_header Connection \"\"; "
            f"proxy_buffers 16 16k; proxy_buffer_size 16k; {tls}")


def caddy_conf(work: Path, name: str, server: dict[str, object], tls_app: dict[str, object] | None) -> Path:
    import json

    conf: dict[str, object] = {
        "admin": {"disabled": True},
        "logging": {"logs": {"default": {"level": "ERROR"}}},
        "storage": {"module": "file_system", "root": str(work / f"{name}-data")},
        "apps": {"http": {"servers": {name: server}}, **({"tls": tls_app} if tls_app else {})},
    }
    path = work / f"{name}.json"
    path.write_text(json.dumps(conf, indent=1))
    return path


class Procs:
    """The relays' processes (not Raven's): started in their own process group, stopped on every path."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> int:
        log = (self.work / f"{name}.log").open("ab")
        with log:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                    env={**os.environ, **(env or {})})
        self.procs[name] = proc
        return proc.pid

    def pids(self, *names: str) -> list[int]:
        return with_children([self.procs[n].pid for n in names])

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def log_tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.work / f"{name}.log").read_text(errors="replace")[-2000:]
        return ""


async def wait_page(url: str, headers: list[str], size: int, what: str, alive: Callable[[], bool]) -> None:
    request = urllib.request.Request(url, headers=dict(h.split(": ", 1) for h in headers))
    request.add_header("Host", f"{NODE}:{ORIGIN_PORT}")
    deadline = time.monotonic() + 20
    last = ""
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{what} exited during start-up")
        try:
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=2).read())
            if len(body) == size:
                return
            last = f"{len(body)} bytes, expected {size}"
        except OSError as exc:
            last = str(exc)
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{what} did not serve the page within 20 s: {last}")


async def measure(path: str, url: str, headers: list[str], pids: Callable[[], list[int]],
                  args: argparse.Namespace) -> Row:
    row = Row(path)
    for conc in (32, 1):
        r = await hey(url, headers, conc, args.duration)
        if conc == 32:
            row.c32_rps, row.c32_p50, row.c32_p99 = r.rps, r.p50_ms, r.p99_ms
        else:
            row.c1_rps, row.c1_p50, row.c1_p99 = r.rps, r.p50_ms, r.p99_ms
        if r.errors:
            row.errors.append(f"c={conc}: {r.errors}")
    watched = pids()
    before = cpu_seconds(watched)
    r = await hey(url, headers, PACED_WORKERS, args.duration, args.rate / PACED_WORKERS)
    used = cpu_seconds(watched) - before
    row.paced_rps = r.ok / args.duration
    row.cpu_ms = used * 1000 / max(1, r.ok)
    if r.errors:
        row.errors.append(f"paced: {r.errors}")
    print(f"  {row.path}: c=32 {row.c32_rps:,.0f} req/s, c=1 {row.c1_rps:,.0f} req/s (p50 {row.c1_p50:.2f} ms), "
          f"{row.cpu_ms:.3f} ms CPU per scrape at {row.paced_rps:,.0f}/s", flush=True)
    return row


def median_row(rows: list[Row]) -> Row:
    """Each figure's median over the rounds (the rounds interleave the paths, so load hits them alike)."""
    out = Row(rows[0].path, errors=[e for r in rows for e in r.errors])
    for name in ("c32_rps", "c32_p50", "c32_p99", "c1_rps", "c1_p50", "c1_p99", "paced_rps", "cpu_ms"):
        setattr(out, name, statistics.median(getattr(r, name) for r in rows))
    return out


async def run(args: argparse.Namespace, work: Path, procs: Procs) -> list[Row]:
    global ORIGIN_PORT
    page = work / "page.txt"
    page.write_bytes(render_metrics(NODE, gpus=8))
    size = page.stat().st_size
    ORIGIN_PORT = free_port()
    token = secrets.token_hex(32)
    headers = [f"Authorization: Bearer {token}"]
    pki = work / "pki"  # the peers' hops: a server certificate for the back, a client one for the front
    authority.create_ca(pki, common_name="bench CA")
    authority.issue(pki, pki, "gateway", "peer-back", dns_names=["peer-back"], ip_addresses=["127.0.0.1"], days=1)
    authority.issue(pki, pki, "agent", "peer-front", pools=["bench"], days=1)
    ca, srv, srv_key = pki / "ca.pem", pki / "peer-back.pem", pki / "peer-back-key.pem"
    cli, cli_key = pki / "peer-front.pem", pki / "peer-front-key.pem"

    origin = nginx_conf(work, "origin", f"listen 127.0.0.1:{ORIGIN_PORT};", "",
                        f'default_type "text/plain; version=0.0.4; charset=utf-8"; root {work}; '
                        f"try_files /{page.name} =404;")
    procs.start("origin", ["nginx", "-e", str(work / "origin-error.log"), "-c", str(origin)])
    print(f"page: {size} bytes (dcgm-shaped, 8 GPUs), served by nginx on 127.0.0.1:{ORIGIN_PORT}; "
          f"{args.duration} s per run; client: hey without gzip; {os.cpu_count()} CPUs", flush=True)

    targets: list[tuple[str, str, Callable[[], list[int]]]] = []  # (path, url, the relay's processes)
    clusters: list[LocalCluster] = []
    try:
        for name in args.paths:
            targets.append(await start_path(name, work, procs, clusters, token, headers, size, ca, (srv, srv_key),
                                            (cli, cli_key)))
        rounds: dict[str, list[Row]] = {path: [] for path, _, _ in targets}
        for n in range(args.rounds):
            print(f"round {n + 1} of {args.rounds}", flush=True)
            for path, url, pids in targets:
                rounds[path].append(await measure(path, url, headers, pids, args))
    finally:
        for cluster in clusters:
            await cluster.close()
    return [median_row(rows) for rows in rounds.values()]


async def start_path(name: str, work: Path, procs: Procs, clusters: list[LocalCluster], token: str,
                     headers: list[str], size: int, ca: Path, server: tuple[Path, Path],
                     client: tuple[Path, Path]) -> tuple[str, str, Callable[[], list[int]]]:
    """Starts one path's relays; returns its name, its URL and how to find its processes."""
    (srv, srv_key), (cli, cli_key) = server, client
    if name == "nginx":
        back, front = free_port(), free_port()
        back_conf = nginx_conf(
            work, "nginx-back",
            f"listen 127.0.0.1:{back} ssl; ssl_certificate {srv}; ssl_certificate_key {srv_key}; "
            f"ssl_protocols TLSv1.3; ssl_client_certificate {ca}; ssl_verify_client on;",
            f"upstream origin {{ server 127.0.0.1:{ORIGIN_PORT}; keepalive 64; }}", proxy_to("origin"))
        front_conf = nginx_conf(
            work, "nginx-front", f"listen 127.0.0.1:{front};",
            f"upstream back {{ server 127.0.0.1:{back}; keepalive 64; }}",
            proxy_to("back", f"proxy_ssl_certificate {cli}; proxy_ssl_certificate_key {cli_key}; "
                             f"proxy_ssl_trusted_certificate {ca}; proxy_ssl_verify on; "
                             "proxy_ssl_name peer-back; proxy_ssl_protocols TLSv1.3; "
                             "proxy_ssl_session_reuse on;"))
        for n, conf in (("nginx-back", back_conf), ("nginx-front", front_conf)):
            procs.start(n, ["nginx", "-e", str(work / f"{n}-error.log"), "-c", str(conf)])
        url = f"http://127.0.0.1:{front}/metrics"
        await wait_page(url, headers, size, "nginx", lambda: all(
            procs.procs[n].poll() is None for n in ("nginx-back", "nginx-front")))
        return "nginx -> TLS 1.3 -> nginx (C)", url, lambda: procs.pids("nginx-back", "nginx-front")
    if name == "caddy":
        back, front = free_port(), free_port()
        back_conf = caddy_conf(work, "caddy-back", {
            "listen": [f"127.0.0.1:{back}"],
            "automatic_https": {"disable": True},
            "strict_sni_host": False,  # the Host header names the node, the SNI the relay (as for nginx)
            "tls_connection_policies": [{
                "certificate_selection": {"any_tag": ["peer"]},
                "protocol_min": "tls1.3",
                "client_authentication": {"trusted_ca_certs_pem_files": [str(ca)], "mode": "require_and_verify"},
            }],
            "routes": [{"handle": [{"handler": "reverse_proxy",
                                    "upstreams": [{"dial": f"127.0.0.1:{ORIGIN_PORT}"}]}]}],
        }, {"certificates": {"load_files": [{"certificate": str(srv), "key": str(srv_key), "tags": ["peer"]}]}})
        front_conf = caddy_conf(work, "caddy-front", {
            "listen": [f"127.0.0.1:{front}"],
            "automatic_https": {"disable": True},
            "routes": [{"handle": [{
                "handler": "reverse_proxy",
                "upstreams": [{"dial": f"127.0.0.1:{back}"}],
                "transport": {"protocol": "http", "versions": ["2"], "tls": {
                    "client_certificate_file": str(cli), "client_certificate_key_file": str(cli_key),
                    "root_ca_pem_files": [str(ca)], "server_name": "peer-back"}},
            }]}],
        }, None)
        env = {"GOMAXPROCS": "1", "HOME": str(work), "XDG_DATA_HOME": str(work / "xdg-data"),
               "XDG_CONFIG_HOME": str(work / "xdg-config")}
        for n, conf in (("caddy-back", back_conf), ("caddy-front", front_conf)):
            procs.start(n, ["caddy", "run", "--config", str(conf)], env)
        url = f"http://127.0.0.1:{front}/metrics"
        await wait_page(url, headers, size, "caddy", lambda: all(
            procs.procs[n].poll() is None for n in ("caddy-back", "caddy-front")))
        return "caddy -> HTTP/2, TLS 1.3 -> caddy (Go)", url, lambda: procs.pids("caddy-back", "caddy-front")
    # raven-compiled / raven-pure / raven-aiohttp (the installed build, aiohttp's server on the front port)
    build = name.removeprefix("raven-")
    server = "lean"
    if build == "aiohttp":
        build, server = "compiled", "aiohttp"
    for attempt in range(3):  # a port free_port chose may be taken meanwhile (another process's client)
        pool = PoolSpec("bench", [SimNode(NODE, "127.0.0.1", ORIGIN_PORT)], agents=1)
        cluster = LocalCluster(work / f"{name}-{attempt}", [pool], allowed_ports=[ORIGIN_PORT],
                               front_token=token, env={"RAVEN_BUILD": build},
                               # one client, one node, 32 in flight: allowed here (by default a client address
                               # holds a quarter of a node's 64; Prometheus scrapes a target one at a time)
                               gateway_settings={"log_level": "warning",
                                                 "front": {"client_share": 1.0, "server": server}},
                               agent_settings={"log_level": "warning"})
        clusters.append(cluster)
        try:
            await cluster.start()
            break
        except RuntimeError:
            await cluster.close()
            if attempt == 2:
                raise
    gateway = cluster.gateway
    assert gateway is not None
    pids = [gateway.process.pid, *(a.process.pid for a in cluster.agents.values())]
    running = await version_of(cluster)
    url = cluster.front_url + "/metrics"
    watched = [gateway.process, *(a.process for a in cluster.agents.values())]
    await wait_page(url, headers, size, "raven", lambda: all(p.returncode is None for p in watched))
    return f"raven gateway -> tunnel -> agent ({running}, {server} front)", url, lambda: with_children(pids)


async def version_of(cluster: LocalCluster) -> str:
    """What `raven --version` says under this cluster's environment (the build actually running)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "raven.cli", "--version",
                                                env={**os.environ, **cluster.env}, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    m = re.search(r"(\w+) build\)", out.decode())
    return f"{m.group(1)} build" if m else out.decode().strip()


def report(rows: list[Row], rate: float) -> None:
    print(f"\n{'path':<52} {'c=32 req/s':>10} {'p50/p99 ms':>13} {'c=1 req/s':>10} {'p50/p99 ms':>13} "
          f"{'CPU ms/scrape':>13} {'at req/s':>8}")
    for r in rows:
        print(f"{r.path:<52} {r.c32_rps:>10,.0f} {r.c32_p50:>6.2f}/{r.c32_p99:<6.2f} {r.c1_rps:>10,.0f} "
              f"{r.c1_p50:>6.2f}/{r.c1_p99:<6.2f} {r.cpu_ms:>13.3f} {r.paced_rps:>8.0f}")
        for e in r.errors:
            print(f"    errors: {e}")
    print(f"(CPU: user + system of both relay processes, from /proc, hey paced at {rate:.0f}/s by "
          f"{PACED_WORKERS} workers)")
    peers = [r for r in rows if not r.path.startswith("raven")]
    for raven in (r for r in rows if r.path.startswith("raven")):
        for peer in peers:
            print(f"{raven.path.split('(')[-1].rstrip(')'):>10} raven / {peer.path.split(' ')[0]:<6}: "
                  f"c=32 {raven.c32_rps / peer.c32_rps:.2f}x, c=1 {raven.c1_rps / peer.c1_rps:.2f}x "
                  f"(p50 {raven.c1_p50:.2f} vs {peer.c1_p50:.2f} ms), CPU per scrape "
                  f"{raven.cpu_ms / peer.cpu_ms:.2f}x")


def cli() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=int, default=8, help="seconds per measurement (default 8)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over all paths, interleaved; medians (default 1)")
    p.add_argument("--rate", type=float, default=667.0, help="paced scrapes/s for the CPU figure (default 667)")
    p.add_argument("--paths", nargs="+", default=["nginx", "caddy", "raven-compiled", "raven-pure"],
                   choices=["nginx", "caddy", "raven-compiled", "raven-pure", "raven-aiohttp"],
                   help="what to run, in this order")
    args = p.parse_args()
    ensure_packages()
    work = Path(tempfile.mkdtemp(prefix="raven-peers-"))
    work.chmod(0o755)  # nginx's workers may run as another user and read the page here
    procs = Procs(work)

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        rows = asyncio.run(run(args, work, procs))
    except (RuntimeError, RavenError, OSError, subprocess.CalledProcessError) as exc:
        print(f"bench: {exc!r}", file=sys.stderr)
        if os.environ.get("BENCH_DEBUG"):
            raise
        for name in procs.procs:
            if tail := procs.log_tail(name):
                print(f"--- {name}.log\n{tail}", file=sys.stderr)
        return 1
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(rows, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
