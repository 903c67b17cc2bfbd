"""Run Debian's dnsmasq on loopback, answering from a hosts file (like CoreDNS's hosts plugin)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

from raven.demo.launch import free_port


class Dnsmasq:
    def __init__(self, hosts_file: Path, address: str = "127.0.0.1", watch_dir: bool = False,
                 more_hosts: Sequence[Path] = ()) -> None:
        """``watch_dir``: ``hosts_file`` is a folder that dnsmasq watches (--hostsdir, inotify), re-reading
        changed files by itself as CoreDNS's hosts plugin does with ``reload``. ``more_hosts``: more files
        read beside it (the shards of a split hosts file, as several CoreDNS server blocks read them)."""
        self.hosts_file = hosts_file
        self.more_hosts = tuple(more_hosts)
        self.watch_dir = watch_dir
        self.address = address
        self.port = 0
        self.process: asyncio.subprocess.Process | None = None

    @property
    def server(self) -> str:
        return f"{self.address}:{self.port}"

    async def start(self) -> None:
        exe = shutil.which("dnsmasq", path="/usr/sbin:/usr/bin:/sbin:/bin")
        if exe is None:
            raise RuntimeError("dnsmasq is not installed (Debian package dnsmasq-base; scripts/test.sh installs it)")
        self.port = free_port(self.address)
        self.process = await asyncio.create_subprocess_exec(
            exe, "--keep-in-foreground", f"--port={self.port}", f"--listen-address={self.address}",
            "--bind-interfaces", "--no-resolv", "--no-hosts",
            f"--hostsdir={self.hosts_file}" if self.watch_dir else f"--addn-hosts={self.hosts_file}",
            *(f"--addn-hosts={path}" for path in self.more_hosts),
            "--user=root", "--group=root", "--pid-file=", "--log-facility=/dev/null", "--cache-size=0",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        await asyncio.sleep(0.3)
        if self.process.returncode is not None:
            err = await self.process.stderr.read() if self.process.stderr else b""
            raise RuntimeError(f"dnsmasq exited: {err.decode(errors='replace')}")

    def reload(self) -> None:
        """dnsmasq re-reads --addn-hosts files on SIGHUP."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGHUP)

    async def close(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                async with asyncio.timeout(5):
                    await self.process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
