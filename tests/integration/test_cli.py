"""The command line: help that helps, configuration errors that name the field."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.service import Agent
from raven import pki
from raven.cli import main
from raven.config import AgentConfig, GatewayConfig, build
from raven.errors import ConfigError
from raven.version import describe
from tests.support.paths import ROOT


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raven.cli", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("cmd", [[], ["gateway"], ["agent"], ["certs"], ["demo"], ["certs", "issue", "agent"]])
def test_help(cmd: list[str]) -> None:
    out = run(*cmd, "--help")
    assert out.returncode == 0
    assert "usage: raven" in out.stdout
    assert len(out.stdout.splitlines()) > 5


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    pki.create_ca(tmp_path)
    pki.issue(tmp_path, tmp_path, "gateway", "gw", dns_names=["gw"])
    pki.issue(tmp_path, tmp_path, "agent", "a1", pools=["pool-a"])
    return tmp_path


def test_gateway_config_from_file_env_and_flags(certs: Path) -> None:
    path = certs / "gw.yaml"
    path.write_text(
        "front:\n  listen: 127.0.0.1:9999\n  allowed_ports: [9400]\n"
        "tls: {cert: gw.pem, key: gw-key.pem, ca: ca.pem}\n"
    )
    env = {"RAVEN_FRONT__ALLOWED_PORTS": "[9400, 9100]"}
    cfg = build(GatewayConfig, path, ["front.request_timeout=7"], environ=env)
    assert cfg.front.listen == "127.0.0.1:9999"
    assert cfg.front.allowed_ports == [9400, 9100]
    assert cfg.front.request_timeout == 7
    assert cfg.tls.cert == certs / "gw.pem"


def test_invalid_config_names_the_field(certs: Path) -> None:
    path = certs / "agent.yaml"
    path.write_text(
        "pool: Pool_A\ngateway: {url: 'http://x:1/tunnel'}\nnodes: [{name: edge-1, address: 10.0.0.1}, "
        "{name: edge-1, address: 10.0.0.2}]\ntls: {cert: a1.pem, key: missing.pem, ca: ca.pem}\nbogus: 1\n"
    )
    with pytest.raises(ConfigError) as info:
        build(AgentConfig, path, environ={})
    text = str(info.value)
    assert "pool: " in text and "'Pool_A' is not a valid pool name" in text
    assert "gateway.url" in text or "gateway: url: must start with wss://" in text
    assert "tls: key: file" in text
    assert "bogus" in text


def test_settings_the_wire_or_the_heartbeat_cannot_honour_are_refused(certs: Path) -> None:
    path = certs / "agent.yaml"
    path.write_text(
        "pool: pool-a\nnodes: [{name: edge-1, address: 10.0.0.5/24}, {name: edge-2, address: 'fe80::1'}, "
        "{name: edge-3, address: node-3.lan}]\ntls: {cert: a1.pem, key: a1-key.pem, ca: ca.pem}\n"
        "limits: {max_frame: 65536}\n"
    )
    with pytest.raises(ConfigError) as info:
        build(AgentConfig, path, environ={})
    text = str(info.value)
    assert "nodes.0.address: '10.0.0.5/24' is neither an IP address nor a host name" in text
    assert "nodes.1" not in text and "nodes.2" not in text
    assert "limits.max_frame" in text
    path.write_text("pool: pool-a\ntls: {cert: a1.pem, key: a1-key.pem, ca: ca.pem}\n"
                    "limits: {heartbeat_interval: 15, heartbeat_timeout: 10}\n")
    with pytest.raises(ConfigError) as info:
        build(AgentConfig, path, environ={})
    assert "heartbeat_timeout (10s) must be at least twice heartbeat_interval (15s)" in str(info.value)


def test_cli_exits_2_with_a_clear_message(certs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = certs / "gw.yaml"
    path.write_text("front: {listen: nowhere}\ntls: {cert: gw.pem, key: gw-key.pem, ca: ca.pem}\n")
    assert main(["gateway", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "front.listen: expected HOST:PORT, got 'nowhere'" in err
    assert "Traceback" not in err
    path.write_text("front: [unclosed\n")
    assert main(["gateway", "--config", str(path)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["gateway", "--config", str(certs / "nope.yaml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_agent_refuses_a_pool_outside_its_certificate(certs: Path) -> None:
    path = certs / "agent.yaml"
    path.write_text("pool: pool-b\ntls: {cert: a1.pem, key: a1-key.pem, ca: ca.pem}\n")
    out = run("agent", "--config", str(path))
    assert out.returncode == 1
    assert "pool 'pool-b' is not in certificate" in out.stderr
    assert "Traceback" not in out.stderr


def test_agent_pool_defaults_to_its_certificates_only_pool(certs: Path) -> None:
    path = certs / "agent.yaml"
    path.write_text("tls: {cert: a1.pem, key: a1-key.pem, ca: ca.pem}\n")
    assert Agent(build(AgentConfig, path, environ={})).pool == "pool-a"
    pki.issue(certs, certs, "agent", "a2", pools=["pool-a", "pool-b"])
    path.write_text("tls: {cert: a2.pem, key: a2-key.pem, ca: ca.pem}\n")
    out = run("agent", "--config", str(path))
    assert out.returncode == 1
    assert "names 2 pools (pool-a, pool-b): set the pool this agent serves" in out.stderr
    assert "Traceback" not in out.stderr


def test_check_prints_effective_config(certs: Path) -> None:
    path = certs / "agent.yaml"
    path.write_text("pool: pool-a\ntls: {cert: a1.pem, key: a1-key.pem, ca: ca.pem}\n")
    out = run("agent", "--config", str(path), "--check", "--gateway-url", "wss://gw.example:10262/tunnel")
    assert out.returncode == 0, out.stderr
    assert '"url": "wss://gw.example:10262/tunnel"' in out.stdout


@pytest.mark.parametrize(("name", "model"), [("gateway", GatewayConfig), ("agent", AgentConfig)])
def test_example_configs_are_valid(name: str, model: type[GatewayConfig] | type[AgentConfig], certs: Path) -> None:
    path = ROOT / "deploy" / "examples" / f"{name}.yaml"
    cert = "gw" if name == "gateway" else "a1"
    overrides = [f"tls.cert={certs / cert}.pem", f"tls.key={certs / cert}-key.pem", f"tls.ca={certs / 'ca.pem'}"]
    cfg = build(model, path, overrides, environ={})
    assert cfg.log_level == "info"


def _setting_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        for t in (*getattr(field.annotation, "__args__", ()), field.annotation):
            if isinstance(t, type) and issubclass(t, BaseModel):
                out += _setting_paths(t, f"{prefix}{name}.")
    return out


@pytest.mark.parametrize(("name", "model"), [("gateway", GatewayConfig), ("agent", AgentConfig)])
def test_example_configs_show_every_setting(name: str, model: type[BaseModel]) -> None:
    """deploy/examples/ cannot drift from the configuration model: every setting is there, set or commented,
    and nothing there is not a setting (a renamed field fails here)."""
    text = (ROOT / "deploy" / "examples" / f"{name}.yaml").read_text()
    keys = set(re.findall(r"^\s*#?\s*-?\s*([a-z_][a-z0-9_]*):", text, re.MULTILINE))
    settings = _setting_paths(model)
    missing = [p for p in settings if p.split(".")[-1] not in keys]
    assert not missing, f"deploy/examples/{name}.yaml does not show {missing}"
    leaves = {p.split(".")[-1] for p in settings}
    unknown = {k for k in re.findall(r"^\s*-?\s*([a-z_][a-z0-9_]*):", text, re.MULTILINE)} - leaves
    assert not unknown, f"deploy/examples/{name}.yaml has keys that are no setting: {sorted(unknown)}"


def test_tool_commands_tell_a_dead_server_from_a_wrong_command_line() -> None:
    out = run("hosts", "render", "--gateway", "http://127.0.0.1:1")
    assert out.returncode == 1 and "cannot connect to http://127.0.0.1:1" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    out = run("dns", "check", "--server", "127.0.0.1", "--node", "edge-1", "--address", "10.0.0.1", "--timeout", "-1")
    assert out.returncode == 2 and "must be more than 0" in out.stderr
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # a DNS server that never answers
        silent.bind(("127.0.0.1", 0))
        server = f"127.0.0.1:{silent.getsockname()[1]}"
        out = run("dns", "check", "--server", server, "--node", "edge-1", "--address", "10.0.0.1", "--timeout", "0.3")
    assert out.returncode == 1
    assert "no answer from the server in time" in out.stdout
    assert f"the DNS server {server} did not answer" in out.stdout and "CoreDNS" not in out.stdout


@pytest.mark.parametrize("service", ["gateway", "agent"])
def test_each_service_answers_version(service: str) -> None:
    """`raven gateway --version` (what a container's args make of `--version`) answers as `raven --version`."""
    out = run(service, "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == describe() == run("--version").stdout.strip()


def test_an_unknown_setting_names_its_section_and_the_setting_meant(certs: Path) -> None:
    path = certs / "agent.yaml"
    path.write_text(
        "pool: pool-a\ntls: {cert: a1.pem, key: a1-key.pem, ca: ca.pem}\nlog_levle: debug\n"
        "limits: {heartbeat_timout: 30}\nnodes: [{name: edge-1, adress: 10.0.0.1}]\n"
        "layer3: {mtuu: 1400}\nzzzz: 1\n"
    )
    with pytest.raises(ConfigError) as info:
        build(AgentConfig, path, environ={})
    text = str(info.value)
    assert "Extra inputs" not in text
    assert "  log_levle: unknown setting 'log_levle' at the top level; did you mean 'log_level'?" in text
    assert ("  limits.heartbeat_timout: unknown setting 'heartbeat_timout' in section 'limits'; "
            "did you mean 'heartbeat_timeout'?") in text
    assert "  nodes.0.adress: unknown setting 'adress' in section 'nodes.0'; did you mean 'address'?" in text
    assert "  layer3.mtuu: unknown setting 'mtuu' in section 'layer3'; did you mean 'mtu'?" in text
    # Nothing near: the section's settings are listed instead.
    assert re.search(r"  zzzz: unknown setting 'zzzz' at the top level; the settings there: name, pool, ", text)
    # A layer-3 section parsed on its own (raven routes) says the same.
    from raven.layer3.config import RoutesLayer3, parse
    with pytest.raises(ConfigError) as info:
        parse(RoutesLayer3, {"gateway": "10.0.0.1", "cidrs": ["10.1.0.0/16"], "intervall": 5}, "routes")
    assert "  routes.intervall: unknown setting 'intervall' in section 'routes'; did you mean 'interval'?" in str(
        info.value)


def test_a_copied_example_reports_the_files_its_relative_paths_name(tmp_path: Path) -> None:
    """deploy/examples/local/ names certs/dev/ relative to its own folder; copied elsewhere, a missing file is
    reported as the one file it names (absolute, normalised), not as '<folder>/../../../certs/dev/...'."""
    folder = tmp_path / "copied"
    folder.mkdir()
    (folder / "gateway.yaml").write_text((ROOT / "deploy/examples/local/gateway.yaml").read_text())
    with pytest.raises(ConfigError) as info:
        build(GatewayConfig, folder / "gateway.yaml", environ={})
    meant = os.path.normpath(folder / "../../../certs/dev/raven-gateway.pem")
    assert f"tls: cert: file '{meant}' does not exist" in str(info.value), info.value
    assert "/../" not in str(info.value)
    # A file named in a flag is relative to the working folder, and reported the same way.
    out = subprocess.run([sys.executable, "-m", "raven.cli", "agent", "--cert", "x/../nope.pem", "--key", "k.pem",
                          "--ca", "ca.pem"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if not k.startswith("RAVEN_")})
    assert out.returncode == 2
    assert f"tls: cert: file '{tmp_path / 'nope.pem'}' does not exist" in out.stderr, out.stderr


def test_environment_variables_that_name_no_setting_are_ignored_and_a_nested_typo_is_refused(
        certs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As the README says: a RAVEN_* variable whose first part names no setting is not configuration (RAVEN_NO_UVLOOP,
    a Kubernetes Service's variables) and is ignored, with a warning when it is near a setting's name; one that names
    a section but no setting in it is refused like a typo in the file, naming the variable."""
    path = certs / "agent.yaml"
    path.write_text("pool: pool-a\ntls: {cert: a1.pem, key: a1-key.pem, ca: ca.pem}\n")
    ignored = {"RAVEN_NO_UVLOOP": "1", "RAVEN_GATEWAY_SERVICE_HOST": "10.96.0.7", "RAVEN_LOG_LEVL": "debug"}
    with caplog.at_level(logging.WARNING, "raven.config"):
        cfg = build(AgentConfig, path, environ={**ignored, "RAVEN_LIMITS__HEARTBEAT_TIMEOUT": "30"})
    assert cfg.limits.heartbeat_timeout == 30 and cfg.log_level == "info"
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["environment variable RAVEN_LOG_LEVL names no setting and is ignored; "
                      "did you mean RAVEN_LOG_LEVEL?"], warned
    with pytest.raises(ConfigError) as info:
        build(AgentConfig, path, environ={**ignored, "RAVEN_LIMITS__HEARTBEAT_TIMOUT": "30"})
    assert ("  limits.heartbeat_timout: unknown setting 'heartbeat_timout' in section 'limits'; did you mean "
            "'heartbeat_timeout'? (set by RAVEN_LIMITS__HEARTBEAT_TIMOUT)") in str(info.value), info.value
    readme = (ROOT / "README.md").read_text()
    assert "a variable whose first part names no setting is ignored" in " ".join(readme.split())


def test_the_readmes_invalid_configuration_example_is_what_raven_prints(certs: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```\nraven gateway: invalid configuration (gw.yaml):\n", 1)[1].split("```", 1)[0]
    path = certs / "gw.yaml"
    path.write_text("front: {listen: nowhere, allowed_port: [9400]}\n"
                    "tls: {cert: gw.pem, key: gw-key.pem, ca: ca.pem}\n")
    with pytest.raises(ConfigError) as info:
        build(GatewayConfig, path, environ={})
    assert str(info.value) == f"invalid configuration ({path}):\n" + block.rstrip("\n")
