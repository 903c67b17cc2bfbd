"""The container image, built here by scripts/image.sh (podman, a base made from Debian packages) and run.

What a platform team's admission policy and an SRE would check: it runs as uid 65532 with a read-only root
file system and no capabilities (layer 3: NET_ADMIN, and that is enough to make its TUN device); it holds no
compiler, no shell, no pip and no pip cache; `raven --version` answers; and a gateway container and an agent
container (host network) carry a real scrape of a simulated node with TLS and the front end's token, then
drain and exit 0 on SIGTERM. The build is cached: after the first (a few minutes, most of it debootstrap),
scripts/image.sh takes seconds. Skipped only where podman cannot run at all (not root, or `podman info`
fails); on a machine where it can, a failed build fails the test.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from raven import __version__
from raven.demo.launch import free_port
from raven.version import describe
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.paths import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# A tag per work tree: two trees testing at once on one machine do not run each other's image.
# What the image's `raven --version` prints: the image ships the compiled build (Dockerfile), whichever build
# this checkout's own install is (compiled by default; pure where setup.sh had no compiler, or RAVEN_COMPILE=0).
IMAGE_DESCRIBES = describe().rsplit("; ", 1)[0] + "; compiled build)"
IMAGE = f"localhost/raven-tunnel:{__version__}-test-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]}"
CONF = Path("/tmp/raven-podman/containers.conf")  # written by scripts/image.sh (ulimits, runc)
SIZE_GOAL = 150 * 1000 * 1000
SIZE_TOLERANCE = 2 * 1000 * 1000  # how far docs/image.md's size may be from a build's
# The user a pod's securityContext gives it, and what an admission policy asks of every container.
LOCKED = ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--user", "65532:65532"]

# Run inside the image by its own Python: who am I, what may I do, and what is lying around.
INSPECT = r"""
import importlib.util, json, os, re
caps = next(l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff:"))
try:
    open("/probe", "w").close(); writable = True
except OSError:
    writable = False
compilers = {"cc", "gcc", "c++", "g++", "cpp", "clang", "tcc", "ld", "as", "x86_64-linux-gnu-gcc", "rustc"}
found = []
for top, dirs, files in os.walk("/"):
    if top in ("/proc", "/sys", "/dev") or top.startswith(("/proc/", "/sys/", "/dev/")):
        dirs[:] = []
        continue
    for name in files + dirs:
        path = os.path.join(top, name)
        if (name in compilers or re.fullmatch(r"(gcc|g\+\+|cc1|cc1plus|clang)(-[0-9.]+)?", name)
                or path.endswith("/.cache/pip") or path.startswith("/var/lib/apt/lists/")
                or path.startswith("/var/cache/apt/") or name.endswith((".whl", ".c", ".h"))):
            found.append(path)
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "caps": int(caps, 16), "root_writable": writable,
    "tmp_writable": os.access("/tmp", os.W_OK), "pip": importlib.util.find_spec("pip") is not None,
    "shell": os.path.exists("/bin/sh"), "found": found,
}))
"""

# Layer 3 in the image: create (and remove) the TUN device in the container's own network namespace.
TUN = r"""
import asyncio
from raven.layer3.tun import TunDevice
from raven.layer3.errors import Layer3Error
async def main() -> None:
    try:
        device = await TunDevice.open("raven0", addresses=["10.77.0.1/24"], mtu=1400)
    except Layer3Error as exc:
        print("refused:", exc)
        return
    await device.close()
    print("tun ok")
asyncio.run(main())
"""


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CONTAINERS_CONF=str(CONF))
    proc = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def run_in_image(opts: list[str], *command: str, python: str | None = None) -> subprocess.CompletedProcess[str]:
    """`podman run --rm` of the image with ``opts``; with ``python``, the image's own interpreter runs it."""
    entry = ["--entrypoint", "/opt/raven/bin/python"] if python is not None else []
    tail = ["-c", python] if python is not None else list(command)
    return podman("run", "--rm", *opts, *entry, IMAGE, *tail, check=False)


@pytest.fixture(scope="module")
def image() -> str:
    """Build (or, with the cache, re-check) the image from this tree; its tag."""
    if os.geteuid() != 0:
        pytest.skip("podman builds and runs the image as root here; not root")
    env = dict(os.environ, RAVEN_IMAGE=IMAGE)
    build = subprocess.run(["bash", str(ROOT / "scripts/image.sh")], env=env, capture_output=True, text=True,
                           timeout=840, stdin=subprocess.DEVNULL)
    if build.returncode != 0:
        if shutil.which("podman") is not None and podman("info", check=False).returncode != 0:
            pytest.skip(f"podman cannot run on this machine: {podman('info', check=False).stderr[-500:]}")
        pytest.fail(f"scripts/image.sh failed:\n{build.stdout[-2000:]}\n{build.stderr[-3000:]}")
    sys.stderr.write(build.stdout)  # the build's times and the image's size, shown with -s or on failure
    return IMAGE


def test_image_is_locked_down_and_holds_no_build_tools(image: str) -> None:
    config = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["raven"]
    assert config["StopSignal"] == "SIGTERM"  # the services drain on it

    version = run_in_image([*LOCKED, "--network", "none"], "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == IMAGE_DESCRIBES

    # With the image's own user and no --user: the same, so a pod without runAsUser is non-root too.
    seen = run_in_image(["--read-only", "--cap-drop", "ALL", "--network", "none"], python=INSPECT)
    assert seen.returncode == 0, seen.stderr
    facts = json.loads(seen.stdout)
    assert (facts["uid"], facts["gid"]) == (65532, 65532)
    assert facts["caps"] == 0, f"effective capabilities {facts['caps']:#x}, want none"
    assert facts["root_writable"] is False and facts["tmp_writable"] is True
    assert facts["pip"] is False, "pip is importable in the runtime image"
    assert facts["shell"] is False, "the runtime image has a shell"
    assert facts["found"] == [], f"build tools or caches left in the image: {facts['found'][:20]}"


def test_image_size_meets_its_goal_and_is_written_down(image: str) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    assert size <= SIZE_GOAL, f"the image is {size / 1e6:.1f} MB, over the {SIZE_GOAL / 1e6:.0f} MB goal"
    doc = (ROOT / "docs/image.md").read_text()
    m = re.search(r"image size: \*\*(\d+(?:\.\d+)?) MB\*\*", doc)
    assert m is not None, "docs/image.md does not state the image size"
    # The dependencies' wheels are the newest pyproject.toml allows, so the size drifts a little between builds.
    assert abs(float(m.group(1)) * 1e6 - size) <= SIZE_TOLERANCE, (
        f"docs/image.md says {m.group(1)} MB; this build is {size / 1e6:.1f} MB ({size:,} bytes): update it")


def test_the_docs_run_block_works_as_written(image: str) -> None:
    """docs/image.md's "Run it" block, run as written (from a shell without CONTAINERS_CONF), prints what the block
    says it prints; only the tag is this test's (the image built from this tree)."""
    doc = (ROOT / "docs/image.md").read_text()
    block = doc.split("<!-- run: tests/e2e/test_image.py", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    command = "\n".join(line for line in block.splitlines() if not line.startswith("#"))
    printed = [line.removeprefix("# ") for line in block.splitlines() if line.startswith("# ")]
    default_tag = f"localhost/raven-tunnel:{__version__}"  # what scripts/image.sh tags by default
    assert default_tag in command, f"docs/image.md runs another image than {default_tag}"
    command = command.replace(default_tag, image)
    if os.geteuid() == 0 and shutil.which("sudo") is None:
        command = re.sub(r"^sudo ", "", command)  # root already; this machine has no sudo
    env = {k: v for k, v in os.environ.items() if k != "CONTAINERS_CONF"}
    ran = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, env=env,
                         stdin=subprocess.DEVNULL)
    assert ran.returncode == 0, f"{command}\n-> {ran.returncode}: {ran.stderr[-2000:]}"
    assert ran.stdout.splitlines() == printed == [IMAGE_DESCRIBES]


def test_layer3_needs_net_admin_and_nothing_more(image: str) -> None:
    if not Path("/dev/net/tun").exists():
        pytest.skip("no /dev/net/tun on this machine")
    # As deploy/components/layer3-gateway runs it: root, every capability dropped but NET_ADMIN.
    base = ["--read-only", "--security-opt", "no-new-privileges", "--user", "0:0", "--network", "none",
            "--device", "/dev/net/tun", "--cap-drop", "ALL"]
    ok = run_in_image([*base, "--cap-add", "NET_ADMIN"], python=TUN)
    assert ok.returncode == 0 and ok.stdout.strip() == "tun ok", ok.stdout + ok.stderr
    refused = run_in_image(base, python=TUN)
    assert refused.returncode == 0 and refused.stdout.startswith("refused: cannot create TUN device raven0"), (
        refused.stdout + refused.stderr)


# ---------------------------------------------------------------- a gateway and an agent, in containers


def make_config(etc: Path, node_host: str, node_port: int) -> dict[str, int]:
    ports = {name: free_port() for name in ("tunnel", "front", "gw_ops", "agent_ops")}
    raven = [sys.executable, "-m", "raven.cli"]
    tls = etc / "tls"
    for cmd in (["certs", "init"], ["certs", "issue", "gateway", "raven-gateway", "--dns", "raven-gateway",
                                    "--ip", "127.0.0.1"], ["certs", "issue", "agent", "agent-pool-a-1",
                                                           "--pool", "pool-a"]):
        subprocess.run([*raven, *cmd, "--dir", str(tls)], check=True, capture_output=True, timeout=60)
    (etc / "front-token").write_text(os.urandom(24).hex() + "\n")
    (etc / "gateway.yaml").write_text(f"""\
replica_id: gateway-image-test
tunnel: {{listen: "127.0.0.1:{ports['tunnel']}"}}
front:
  listen: "127.0.0.1:{ports['front']}"
  allowed_ports: [{node_port}]
  auth: {{token_files: [/etc/raven/front-token]}}
metrics_listen: "127.0.0.1:{ports['gw_ops']}"
hosts: {{service_addresses: [127.0.0.1]}}
drain_linger: 1
drain_grace: 5
tls: {{cert: /etc/raven/tls/raven-gateway.pem, key: /etc/raven/tls/raven-gateway-key.pem, ca: /etc/raven/tls/ca.pem}}
""")
    (etc / "agent.yaml").write_text(f"""\
pool: pool-a
gateway: {{url: "wss://127.0.0.1:{ports['tunnel']}/tunnel", server_name: raven-gateway}}
nodes: [{{name: edge-gpu-1, address: {node_host}}}]
allowed_ports: [{node_port}]
metrics_listen: "127.0.0.1:{ports['agent_ops']}"
drain_grace: 5
tls: {{cert: /etc/raven/tls/agent-pool-a-1.pem, key: /etc/raven/tls/agent-pool-a-1-key.pem, ca: /etc/raven/tls/ca.pem}}
""")
    # As a Secret mounted with fsGroup 65532 would be: readable by the image's user, by no one else.
    for path in [etc, *etc.rglob("*")]:
        os.chown(path, 65532, 65532)
        os.chmod(path, 0o750 if path.is_dir() else 0o440)
    return ports


def get(url: str, headers: dict[str, str], timeout: float = 5) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # loopback only
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A simulated GPU node (dcgm-exporter format) on the host's loopback."""
    host, port = HOSTS[0], pick_node_port(HOSTS[:1])
    log = (tmp_path / "simexporter.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "raven.demo.simexporter", "--node", f"edge-gpu-1={host}:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (_listening(host, port) and get(f"http://{host}:{port}/metrics", {})[0] == 200):
            assert proc.poll() is None and time.monotonic() < deadline, "the simulated node did not start"
            time.sleep(0.2)
        yield host, port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def test_gateway_and_agent_containers_carry_a_scrape_and_drain(
        image: str, node: tuple[str, int], tmp_path: Path) -> None:
    node_host, node_port = node
    etc = tmp_path / "etc"
    etc.mkdir()
    ports = make_config(etc, node_host, node_port)
    token = (etc / "front-token").read_text().strip()
    suffix = f"{os.getpid()}-{time.monotonic_ns()}"
    names = {"gateway": f"raven-test-gateway-{suffix}", "agent": f"raven-test-agent-{suffix}"}
    try:
        for service, name in names.items():
            podman("run", "-d", "--name", name, *LOCKED, "--network", "host", "--stop-timeout", "30",
                   "-v", f"{etc}:/etc/raven:ro", image, service, "--config", f"/etc/raven/{service}.yaml")
        front = f"http://127.0.0.1:{ports['front']}/metrics"
        want = {"Host": f"edge-gpu-1:{node_port}", "Authorization": f"Bearer {token}"}
        deadline = time.monotonic() + 90
        status, body = 0, ""
        while time.monotonic() < deadline:  # 503 (or no listener yet) until the agent has registered
            try:
                status, body = get(front, want)
            except OSError as exc:
                status, body = 0, str(exc)
            if status == 200:
                break
            running = podman("ps", "-q", "--filter", f"name={names['gateway']}").stdout.strip()
            assert running, f"gateway container exited:\n{logs(names['gateway'])}"
            time.sleep(0.5)
        assert status == 200, f"{status} {body[:300]}\n{logs(names['gateway'])}\n{logs(names['agent'])}"
        assert 'DCGM_FI_DEV_GPU_UTIL{gpu="0"' in body and 'Hostname="edge-gpu-1"' in body
        # Proxy mode too, as Prometheus's proxy_url sends it (the token as the proxy password).
        proxy = urllib.request.ProxyHandler({"http": f"http://prometheus:{token}@127.0.0.1:{ports['front']}"})
        with urllib.request.build_opener(proxy).open(f"http://edge-gpu-1:{node_port}/metrics", timeout=10) as r:
            assert r.status == 200 and 'DCGM_FI_DEV_GPU_UTIL{gpu="1"' in r.read().decode()
        # The front end's token is required: without it, a refusal and no metrics.
        refused, body = get(front, {"Host": f"edge-gpu-1:{node_port}"})
        assert refused == 401 and "DCGM" not in body, (refused, body[:300])

        for service in ("agent", "gateway"):  # the agent first, as a rolling agent update would
            podman("kill", "--signal", "TERM", names[service])
            waited = podman("wait", names[service], timeout=60)
            out = logs(names[service])
            assert waited.stdout.strip() == "0", f"{service} exited {waited.stdout.strip()} on SIGTERM:\n{out}"
            assert "drain" in out.lower(), f"{service} did not say it drained:\n{out}"
    finally:
        for name in names.values():
            podman("rm", "-f", "-t", "0", name, check=False)


def logs(name: str) -> str:
    return podman("logs", name, check=False).stderr[-4000:] + podman("logs", name, check=False).stdout[-2000:]

