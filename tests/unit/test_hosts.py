"""Hosts file rendering and atomic publishing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raven.dns.hosts import render
from raven.dns.publisher import write_atomic


def body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def test_render_sorted_exact_names_ipv4_and_ipv6() -> None:
    text = render(["myedge-1", "edge-10", "edge-1", "edge-2", "edge-1"], ["fd00::50", "10.96.0.50"])
    assert body(text) == [
        "10.96.0.50\tedge-1", "fd00::50\tedge-1",
        "10.96.0.50\tedge-10", "fd00::50\tedge-10",
        "10.96.0.50\tedge-2", "fd00::50\tedge-2",
        "10.96.0.50\tmyedge-1", "fd00::50\tmyedge-1",
    ]
    assert text.startswith("# Edge node names served through the Raven tunnel. Written by raven gateway")
    assert "4 node(s) -> 10.96.0.50, fd00::50" in text
    assert render(["b", "a"], ["10.0.0.1"]) == render(["a", "b"], ["10.0.0.1"])  # no timestamp: stable


@pytest.mark.parametrize("name", ["Edge-1", "edge_1", "-edge", "edge-1.", ""])
def test_render_refuses_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="RFC 1123"):
        render([name], ["10.0.0.1"])


def test_render_refuses_bad_address() -> None:
    with pytest.raises(ValueError, match="not an IPv4 or IPv6"):
        render(["edge-1"], ["raven.svc"])


def test_write_only_on_change(tmp_path: Path) -> None:
    path = tmp_path / "edge" / "tunnel-nodes"
    assert write_atomic(path, "one\n") is True
    os.utime(path, (1, 1))
    assert write_atomic(path, "one\n") is False
    assert path.stat().st_mtime == 1  # untouched: CoreDNS's reload sees no change
    assert write_atomic(path, "two\n") is True
    assert path.read_text() == "two\n"
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_crash_between_write_and_rename_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tunnel-nodes"
    write_atomic(path, "old complete file\n")

    def crash(src: str, dst: str) -> None:
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_atomic(path, "new file that must never appear half-written\n")
    assert path.read_text() == "old complete file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tunnel-nodes"]  # no temporary file left behind
