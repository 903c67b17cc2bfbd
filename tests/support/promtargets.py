"""Debian's real Prometheus on loopback, scraping stand-in edge targets: one job ``edge-dcgm`` with a target per
node (label ``node``, as the shipped relabel rule gives it), each served by a small HTTP server in a thread that
answers 200 with one sample, or 503 for the nodes in :attr:`PromTargets.down` (Prometheus then records ``up`` 0).

Synchronous (a thread and a subprocess), so that a module-scoped fixture can hold it across async tests.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from raven.demo.launch import free_port


class PromTargets:
    def __init__(self, workdir: Path, nodes: list[str], job: str = "edge-dcgm") -> None:
        self.workdir, self.nodes, self.job = workdir, nodes, job
        self.down: set[str] = set()
        self.url = ""
        self._server: ThreadingHTTPServer | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        exe = shutil.which("prometheus")
        if exe is None:
            raise RuntimeError("prometheus is not installed (Debian package prometheus; scripts/system-deps.sh)")
        down = self.down

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                node = self.path.rsplit("/", 1)[-1]
                body = b"raven_test_sample 1\n"
                self.send_response(503 if node in down else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        port = self._server.server_address[1]
        targets = [{"targets": [f"127.0.0.1:{port}"], "labels": {"node": n, "__metrics_path__": f"/m/{n}"}}
                   for n in self.nodes]
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": self.job, "static_configs": targets}]}
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "prometheus.yml").write_text(json.dumps(config))
        listen = _free_port()
        with (self.workdir / "prometheus.log").open("wb") as log:
            self._proc = subprocess.Popen(
                [exe, f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{listen}",
                 "--log.level=warn"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        self.url = f"http://127.0.0.1:{listen}"
        self.wait(lambda up: len(up) == len(self.nodes) and all(v == 1 for v in up.values()), 60)
        return self.url

    def up(self) -> dict[str, float]:
        query = urllib.parse.urlencode({"query": f'up{{job="{self.job}"}}'})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=5) as resp:
            doc = json.load(resp)
        return {r["metric"]["node"]: float(r["value"][1]) for r in doc["data"]["result"]}

    def wait(self, condition: Any, timeout: float = 20) -> dict[str, float]:
        """Until Prometheus's ``up`` (node -> value) satisfies ``condition``."""
        deadline = time.monotonic() + timeout
        last: dict[str, float] | str = {}
        while time.monotonic() < deadline:
            try:
                last = self.up()
                if condition(last):
                    return last
            except (OSError, ValueError, KeyError) as exc:
                last = repr(exc)
            time.sleep(0.25)
        raise AssertionError(f"Prometheus's up did not get there within {timeout:g}s: {last}")

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _free_port() -> int:
    return free_port()
