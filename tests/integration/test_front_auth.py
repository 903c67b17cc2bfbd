"""An authenticated front end, the Prometheus way: bearer tokens in Host-header mode, proxy credentials in proxy
mode, rotation without restart, credentials never forwarded, inventory endpoints guarded, a refused open start."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, pick_node_port, start_echo
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

TOKEN = "first-token-0123456789abcdef"
NEW_TOKEN = "second-token-fedcba9876543210"


@dataclass
class Auth:
    cluster: LocalCluster
    port: int
    seen: list[dict[str, str]]

    @property
    def front(self) -> str:
        return f"http://127.0.0.1:{self.cluster.front_port}"

    @property
    def ops(self) -> str:
        return f"http://127.0.0.1:{self.cluster.gateway_metrics_port}"

    @property
    def token_file(self) -> Path:
        return self.cluster.workdir / "front-token"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def auth(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Auth]:
    port = pick_node_port(HOSTS)
    node = SimNode("auth-1", HOSTS[0], port)
    exporter = SimExporter([node])
    await exporter.start()
    seen: list[dict[str, str]] = []
    echo = await start_echo(HOSTS[1], port, seen)
    cluster = LocalCluster(
        tmp_path_factory.mktemp("front-auth"), [PoolSpec("pool-auth", [node, SimNode("auth-echo", HOSTS[1], port)])],
        allowed_ports=[port], front_token=TOKEN,
        gateway_settings={"front": {"allow_connect": True}}, agent_settings={"allow_connect": True},
    )
    try:
        await cluster.start()
        yield Auth(cluster, port, seen)
    finally:
        await cluster.close()
        await echo.cleanup()
        await exporter.close()


async def host_mode(auth: Auth, node: str = "auth-1", token: str | None = TOKEN,
                    extra: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    headers = {"Host": f"{node}:{auth.port}", **(extra or {})}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(f"{auth.front}/metrics", headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.text()


def basic(user: str, password: str) -> str:
    """What Go sends for proxy_url http://USER:PASSWORD@host: Proxy-Authorization: Basic base64(USER:PASSWORD)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


async def proxy_mode(auth: Auth, node: str = "auth-1", proxy_auth: str | None = None,
                     headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    # Plain-HTTP proxying: the proxy credentials travel in the request's own head.
    headers = {**(headers or {}), **({"Proxy-Authorization": proxy_auth} if proxy_auth else {})}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(f"http://{node}:{auth.port}/metrics", proxy=auth.front, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.text()


async def test_host_mode_needs_a_bearer_token(auth: Auth) -> None:
    for token in (None, "wrong-token-0123456789", TOKEN + "x", ""):
        status, headers, body = await host_mode(auth, token=token)
        assert status == 401, (token, body)
        assert headers["WWW-Authenticate"] == 'Bearer realm="raven"'
        assert TOKEN not in body
    status, _, body = await host_mode(auth)
    assert status == 200 and 'Hostname="auth-1"' in body


async def test_nothing_is_revealed_without_credentials(auth: Auth) -> None:
    for node in ("no-such-node", "auth-1"):
        status, _, _ = await host_mode(auth, node=node, token=None)
        assert status == 401
    async with aiohttp.ClientSession() as http:
        async with http.request("TRACE", f"{auth.front}/", headers={"Host": f"auth-1:{auth.port}"}) as resp:
            assert resp.status == 401  # not 405: credentials come first
    assert (await host_mode(auth))[0] == 200


async def test_the_token_is_not_forwarded_to_the_node(auth: Auth) -> None:
    status, _, _ = await host_mode(auth, node="auth-echo")
    assert status == 200
    got = {k.lower(): v for k, v in auth.seen[-1].items()}
    assert "authorization" not in got and TOKEN not in str(got)


async def test_proxy_mode_needs_proxy_credentials(auth: Auth) -> None:
    status, headers, _ = await proxy_mode(auth)
    assert status == 407
    assert headers["Proxy-Authenticate"] == 'Basic realm="raven"'
    status, _, _ = await proxy_mode(auth, proxy_auth=basic("prometheus", "wrong-password-12345"))
    assert status == 407
    # A Bearer token in Authorization is for the target in proxy mode: it does not authenticate to the proxy.
    status, _, _ = await proxy_mode(auth, headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 407
    status, _, body = await proxy_mode(auth, proxy_auth=basic("prometheus", TOKEN))
    assert status == 200 and 'Hostname="auth-1"' in body
    status, _, _ = await proxy_mode(auth, proxy_auth=f"Bearer {TOKEN}")
    assert status == 200


async def test_proxy_credentials_are_not_forwarded_but_the_targets_authorization_is(auth: Auth) -> None:
    status, _, _ = await proxy_mode(auth, node="auth-echo", proxy_auth=basic("p", TOKEN),
                                    headers={"Authorization": "Bearer for-the-exporter"})
    assert status == 200
    got = {k.lower(): v for k, v in auth.seen[-1].items()}
    assert "proxy-authorization" not in got
    assert got["authorization"] == "Bearer for-the-exporter"


async def test_connect_needs_proxy_credentials(auth: Auth) -> None:
    async def connect(extra: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", auth.cluster.front_port)
        try:
            writer.write(f"CONNECT auth-1:{auth.port} HTTP/1.1\r\nHost: auth-1:{auth.port}\r\n{extra}\r\n".encode())
            await writer.drain()
            return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        finally:
            writer.close()

    assert (await connect("")).startswith(b"HTTP/1.1 407")
    assert (await connect(f"Proxy-Authorization: {basic('p', TOKEN)}\r\n")).startswith(b"HTTP/1.1 200")


async def test_tokens_rotate_without_restart(auth: Auth) -> None:
    auth.token_file.write_text(f"{TOKEN}\n{NEW_TOKEN}\n")  # both accepted while Prometheus moves over

    async def new_works() -> bool:
        return (await host_mode(auth, token=NEW_TOKEN))[0] == 200

    await eventually(new_works, timeout=10, what="the new token accepted")
    assert (await host_mode(auth, token=TOKEN))[0] == 200
    auth.token_file.write_text(f"{NEW_TOKEN}\n")  # the old one removed

    async def old_refused() -> bool:
        return (await host_mode(auth, token=TOKEN))[0] == 401

    await eventually(old_refused, timeout=10, what="the old token refused")
    assert (await host_mode(auth, token=NEW_TOKEN))[0] == 200
    auth.token_file.write_text("")  # a broken file: the gateway keeps the tokens it had
    await asyncio.sleep(1.5)
    assert (await host_mode(auth, token=NEW_TOKEN))[0] == 200
    auth.token_file.write_text(f"{TOKEN}\n")

    async def first_works_again() -> bool:
        return (await host_mode(auth, token=TOKEN))[0] == 200

    await eventually(first_works_again, timeout=10, what="back to the first token")


async def test_inventory_endpoints_need_the_token_and_probes_do_not(auth: Auth) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for path in ("/sd", "/nodes", "/hosts"):
            async with http.get(auth.ops + path) as resp:
                assert resp.status == 401, path
                assert resp.headers["WWW-Authenticate"] == 'Bearer realm="raven"'
            async with http.get(auth.ops + path, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 200, path
        for path in ("/healthz", "/readyz", "/metrics"):
            async with http.get(auth.ops + path) as resp:
                assert resp.status == 200, path
            # the refusals above were counted
        async with http.get(auth.ops + "/metrics") as resp:
            assert 'raven_gateway_front_refused_total{reason="auth"}' in await resp.text()


async def test_hosts_render_with_a_token_file(auth: Auth, tmp_path: Path) -> None:
    raven = [sys.executable, "-m", "raven.cli"]
    args = ["hosts", "render", "--gateway", auth.ops, "--address", "10.96.0.50"]
    without = await asyncio.to_thread(subprocess.run, [*raven, *args], capture_output=True, text=True, timeout=30)
    assert without.returncode == 1 and "--token-file" in without.stderr
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    with_token = await asyncio.to_thread(subprocess.run, [*raven, *args, "--token-file", str(token)],
                                         capture_output=True, text=True, timeout=30)
    assert with_token.returncode == 0, with_token.stderr
    assert "10.96.0.50\tauth-1\n" in with_token.stdout


def _gateway_check(tmp_path: Path, front: dict[str, object]) -> subprocess.CompletedProcess[str]:
    cluster = LocalCluster(tmp_path, [PoolSpec("p", [])])
    if not (cluster.certs / "ca.pem").exists():
        cluster.make_pki()
    config = tmp_path / "gw.yaml"
    config.write_text(yaml.safe_dump({
        "front": front,
        "tls": {"cert": str(cluster.certs / "raven-gateway.pem"), "key": str(cluster.certs / "raven-gateway-key.pem"),
                "ca": str(cluster.certs / "ca.pem")},
    }))
    return subprocess.run([sys.executable, "-m", "raven.cli", "gateway", "--config", str(config), "--check"],
                          capture_output=True, text=True, timeout=30, env={**os.environ, "RAVEN_NO_UVLOOP": "1"})


async def test_an_open_front_end_on_a_non_loopback_address_is_refused(tmp_path: Path) -> None:
    refused = await asyncio.to_thread(_gateway_check, tmp_path, {"listen": "0.0.0.0:10263"})
    assert refused.returncode != 0
    assert "front.auth: the front end listens on 0.0.0.0:10263 without credentials" in refused.stderr
    assert "Traceback" not in refused.stderr
    explicit = await asyncio.to_thread(_gateway_check, tmp_path, {"listen": "0.0.0.0:10263", "auth": {"mode": "none"}})
    assert explicit.returncode == 0, explicit.stderr
    loopback = await asyncio.to_thread(_gateway_check, tmp_path, {"listen": "127.0.0.1:10263"})
    assert loopback.returncode == 0, loopback.stderr


async def test_an_explicitly_open_front_end_warns(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, [PoolSpec("p", [])], gateway_settings={"front": {"auth": {"mode": "none"}}})
    cluster.make_pki()
    try:
        gateway = await cluster.start_gateway()
        await eventually(lambda: "NO credentials required" in gateway.log_tail(50), timeout=10)
    finally:
        await cluster.close()


async def test_front_end_over_mutual_tls(tmp_path: Path) -> None:
    """front.tls: the front end speaks TLS and wants a client certificate signed by its CA."""
    import ssl

    port = pick_node_port(HOSTS)
    node = SimNode("mtls-1", HOSTS[2], port)
    exporter = SimExporter([node])
    await exporter.start()
    seen: list[dict[str, str]] = []
    echo = await start_echo(HOSTS[3], port, seen)  # what the node is told of the client's connection
    cluster = LocalCluster(tmp_path, [PoolSpec("pool-m", [node, SimNode("mtls-echo", HOSTS[3], port)], agents=1)],
                           allowed_ports=[port])
    cluster.make_pki()
    certs = cluster.certs
    cluster.gateway_settings = {"front": {"tls": {"cert": str(certs / "raven-gateway.pem"),
                                                  "key": str(certs / "raven-gateway-key.pem"),
                                                  "ca": str(certs / "ca.pem")}}}
    try:
        await cluster.start_gateway()
        await cluster.start_agent(cluster.pools[0], "agent-pool-m-1")
        await cluster.wait_registered(30)
        url = f"https://127.0.0.1:{cluster.front_port}/metrics"
        headers = {"Host": f"mtls-1:{port}"}
        with_cert = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with_cert.load_cert_chain(certs / "agent-pool-m-1.pem", certs / "agent-pool-m-1-key.pem")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url, headers=headers, ssl=with_cert, server_hostname="raven-gateway") as resp:
                assert resp.status == 200
                assert 'Hostname="mtls-1"' in await resp.text()
            async with http.get(url, headers={"Host": f"mtls-echo:{port}"}, ssl=with_cert,
                                server_hostname="raven-gateway") as resp:
                assert resp.status == 200
            assert {k.lower(): v for k, v in seen[-1].items()}["x-forwarded-proto"] == "https"
            without = ssl.create_default_context(cafile=str(certs / "ca.pem"))
            with pytest.raises(aiohttp.ClientError):
                async with http.get(url, headers=headers, ssl=without, server_hostname="raven-gateway") as resp:
                    await resp.read()
    finally:
        await cluster.close()
        await exporter.close()
        await echo.cleanup()
