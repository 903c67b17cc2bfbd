"""The gateway's backfill settings: where kept scrapes are written (Prometheus remote-write receivers) and how."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from raven.config.base import Seconds
from raven.model import Model

TargetLabel = Literal["job", "instance", "node", "pool", "port"]
_ALL_LABELS: tuple[TargetLabel, ...] = ("job", "instance", "node", "pool")


class Receiver(Model):
    url: str = Field(description="the remote-write URL, e.g. http://prometheus:9090/api/v1/write")
    token_file: Path | None = Field(None, description="a file whose first line is a bearer token for it (re-read "
                                    "for every batch: rotation needs no restart)")

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value


class GatewayBackfill(Model):
    """Scrapes agents kept through an outage, written to Prometheus's remote-write receiver(s) (docs/backfill.md)."""

    enabled: bool = Field(True, description="ask agents for what they kept and write it (off: they keep it until "
                          "their caps drop it)")
    receivers: list[Receiver] = Field(default_factory=list, description="every one gets every sample (an HA pair: "
                                      "both); none: backfill is off")
    jobs: dict[int, str] = Field(default_factory=lambda: {9400: "edge-dcgm", 9100: "edge-node"},
                                 description="port -> the job label the scrape configuration gives its targets; a "
                                 "port not here is not written")
    target_labels: list[TargetLabel] = Field(
        default_factory=lambda: list(_ALL_LABELS),
        description="labels added to every sample, those the scrape configuration gives its targets: the shipped one "
        "keeps job, instance (NODE:PORT), node and pool; port is the discovery's port label, for a configuration "
        "that keeps it")
    max_age: Seconds = Field(7200.0, description="samples older than this are refused (the receiver's "
                             "out-of-order window: storage.tsdb.out_of_order_time_window)")
    max_future: Seconds = Field(60.0, description="samples this far ahead of the gateway's clock are refused")
    max_page: int = Field(64 * 1024 * 1024, ge=1024, le=1 << 30, description="largest page taken from a batch")
    max_batch: int = Field(16 * 1024 * 1024, ge=64 * 1024, le=1 << 30, description="largest batch an agent may send")
    poll_interval: Seconds = Field(10.0, description="how often each session is asked for its backlog")
    timeout: Seconds = Field(30.0, description="deadline of one write to a receiver")
    retry_max: Seconds = Field(60.0, description="the longest wait between retries of a failed write")
    concurrency: int = Field(2, ge=1, le=64, description="batches being written at once, all sessions together")
    samples_per_request: int = Field(2000, ge=100, le=1_000_000, description="samples in one remote-write request")
    cpu_share: float = Field(0.5, gt=0, le=1, allow_inf_nan=False, description="the share of one core the catch-up's "
                             "worker process may take: after each request it builds the gateway waits so that building "
                             "takes at most this share of the time (lower: live scrapes feel less of it; the catch-up "
                             "takes longer; 1: unpaced, only the worker's lower CPU priority spares live scrapes)")
    build_timeout: Seconds = Field(60.0, description="deadline of one step of the catch-up's worker process "
                                   "(decoding a batch, or building one request of it): past it the worker is killed "
                                   "and started again, and the batch is asked for again")
    switch_interval: float | None = Field(None, ge=0.0001, le=0.005, allow_inf_nan=False, description="deprecated "
                                          "and ignored (the catch-up's parsing no longer runs in the gateway's "
                                          "process, so the interpreter's thread switch interval is left alone): "
                                          "accepted so that a file that sets it still loads")
