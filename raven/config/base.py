"""What both services' configurations are built from: field types (host:port, method names, ports,
seconds; node and pool names are raven/names.py, the model base raven/model.py), TLS files, the tunnel's limits
and the Kubernetes settings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, model_validator

from raven.model import Model


def _host_port(value: str) -> str:
    _, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return value


HostPort = Annotated[str, AfterValidator(_host_port)]
Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)]


def _method(value: str) -> str:
    if not re.fullmatch(r"[A-Z]{1,20}", value):
        raise ValueError(f"{value!r} is not an HTTP method (upper-case letters, e.g. GET)")
    return value


Method = Annotated[str, AfterValidator(_method)]


class TLSConfig(Model):
    cert: Path = Field(description="PEM certificate of this side")
    key: Path = Field(description="PEM private key of this side")
    ca: Path = Field(description="PEM CA bundle that the peer's certificate must chain to")
    reload_interval: Seconds = Field(60.0, description="how often to re-read rotated certificate files")

    @model_validator(mode="after")
    def _files_exist(self) -> TLSConfig:
        for name in ("cert", "key", "ca"):
            path: Path = getattr(self, name)
            shown = os.path.abspath(path)  # the file meant, whatever the working folder and however it was spelt
            if path.is_dir():
                raise ValueError(f"{name}: {shown!r} is a directory, not a file")
            if not path.is_file():
                raise ValueError(f"{name}: file {shown!r} does not exist")
        return self


class TunnelLimits(Model):
    window: int = Field(256 * 1024, ge=16 * 1024, le=16 * 1024 * 1024, description="per-stream receive window")
    max_streams_per_session: int = Field(1024, ge=1, le=1 << 20)
    max_frame: int = Field(
        1 << 20, ge=256 * 1024, le=16 << 20,
        description="largest tunnel message; must hold a full DATA frame (64 KiB) and an OPEN with 64 KiB of headers",
    )
    heartbeat_interval: float = Field(
        3.0, gt=0, le=3600, allow_inf_nan=False, description="PING after this long without traffic"
    )
    heartbeat_timeout: float = Field(
        10.0, gt=0, le=3600, allow_inf_nan=False, description="a session silent this long is dead"
    )
    handshake_timeout: Seconds = 10.0

    @model_validator(mode="after")
    def _timeout_covers_interval(self) -> TunnelLimits:
        if self.heartbeat_timeout < 2 * self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout:g}s) must be at least twice heartbeat_interval "
                f"({self.heartbeat_interval:g}s), or a healthy session would be taken for dead"
            )
        return self



class KubeSettings(Model):
    enabled: bool = Field(False, description="learn edge nodes from the Kubernetes API (watch Nodes)")
    kubeconfig: Path | None = Field(None, description="kubeconfig file; default: in-cluster service account")
    pool_label: str = Field("apps.openyurt.io/nodepool", description="Node label naming the node's edge pool")
    node_selector: str = Field("", description="extra label selector for edge Nodes (e.g. 'node-role/edge=true')")
    reach_label: str = Field(
        "raven.io/reach", description="Node label saying how its pool is reached (tunnel, direct, layer3); "
        "without it, OpenYurt's openyurt.io/is-edge-worker=false means direct (gateway/pools.py)",
    )
