"""A hosts-file sink that never answers (a hung NFS or FUSE mount) fails within its deadline, does not hold the
other sinks back, and does not strand one more worker thread per retry (raven/dns/publisher.py)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from raven.dns import publisher
from raven.dns.publisher import HostsPublisher, file_sink
from raven.errors import RavenError


async def test_a_stuck_file_sink_fails_in_time_and_is_not_written_twice_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stuck = threading.Event()
    calls: list[Path] = []
    real = publisher.write_atomic

    def hung_write(path: Path, content: str) -> bool:
        calls.append(path)
        if path.name == "hung":
            stuck.wait(30)  # the mount answers nothing until released
        return real(path, content)

    monkeypatch.setattr(publisher, "write_atomic", hung_write)
    monkeypatch.setattr(publisher, "SINK_TIMEOUT", 0.3)
    good = tmp_path / "good"
    hung_sink = file_sink(tmp_path / "hung")
    pub = HostsPublisher(lambda: ["edge-1", "edge-2"], ["10.96.0.10"], 0.1,
                         [("hung", 0, hung_sink), ("good", 0, file_sink(good))])
    try:
        assert await asyncio.wait_for(pub.publish_once(), 10) is False  # the hung one failed, in time
        assert "edge-2" in good.read_text()  # and the next sink was published all the same
        # A retry while the first write still hangs starts no second thread for that file.
        assert await asyncio.wait_for(pub.publish_once(), 10) is False
        assert calls.count(tmp_path / "hung") == 1
        # Asked directly, the busy sink says why with an error a user acts on (the project's one hierarchy).
        with pytest.raises(RavenError, match="has not finished"):
            await hung_sink("edge-1\n")
    finally:
        stuck.set()
    for _ in range(100):  # the hung write finishes once the mount answers
        if (tmp_path / "hung").exists():
            break
        await asyncio.sleep(0.05)
    assert await asyncio.wait_for(pub.publish_once(), 10) is True  # then publishing works again
    assert "edge-1" in (tmp_path / "hung").read_text()
