"""The hosts file that CoreDNS's hosts plugin (or dnsmasq's --addn-hosts) serves.

One source of truth renders the whole file: every edge node name, exactly (no suffix
matching: ``edge-1`` and ``myedge-1`` are different names), sorted, one line per node and
service address (IPv4 and IPv6), pointing at the Raven front Service. The content holds
no timestamp, so it changes only when the set of nodes or addresses changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path

from raven.aio import cancel_and_wait
from raven.protocol import wire

log = logging.getLogger("raven.hosts")

# A ConfigMap's data may hold at most 1 MiB (etcd's object limit): the hosts file must fit in it.
CONFIGMAP_MAX_BYTES = 1024 * 1024 - 8 * 1024  # what is left after the object's metadata


def render(names: Iterable[str], addresses: Sequence[str], writer: str = "raven gateway",
           direct: Mapping[str, str] | None = None) -> str:
    """The whole hosts file. Raises ValueError for an invalid name or address.

    ``direct``: names of pools scraped without the tunnel, each mapped to its own node's address
    (``hosts.direct: internal-ip``); a name in both is the tunnel's.
    """
    addrs = []
    for a in addresses:
        try:
            addrs.append(ipaddress.ip_address(a))
        except ValueError:
            raise ValueError(f"{a!r} is not an IPv4 or IPv6 address") from None
    ordered = sorted(addrs, key=lambda ip: (ip.version, ip))
    unique = sorted(set(names))
    for name in unique:
        if not wire.valid_node_name(name):
            raise ValueError(f"{name!r} is not a valid RFC 1123 node name")
    lines = [
        f"# Edge node names served through the Raven tunnel. Written by {writer}; do not edit:",
        "# every write replaces the whole file.",
        f"# {len(unique)} node(s) -> {', '.join(str(a) for a in ordered) or 'no service address configured'}",
    ]
    own = {}
    for name, address in (direct or {}).items():
        if name in unique or not wire.valid_node_name(name):
            continue
        try:
            own[name] = ipaddress.ip_address(address)
        except ValueError:
            raise ValueError(f"{address!r} (node {name!r}) is not an IPv4 or IPv6 address") from None
    if own:
        lines.append(f"# {len(own)} node(s) of direct and layer3 pools -> their own addresses")
    texts = [f"{ip}\t" for ip in ordered]  # formatted once: an IPv6 address's str() is slow
    for name in sorted({*unique, *own}) if own else unique:
        if name in own:
            lines.append(f"{own[name]}\t{name}")
            continue
        for text in texts:
            lines.append(text + name)
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, content: str) -> bool:
    """Write ``content`` to ``path`` through a temporary file and a rename; only if it changed.

    A crash at any point leaves either the old file or the new one, never a partial one.
    Returns True when the file was written.
    """
    try:
        if path.read_text() == content:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return True


Sink = Callable[[str], Awaitable[bool]]


class HostsPublisher:
    """Re-render and publish after changes, debounced: a burst of registrations is one write.

    With ``shards`` > 1 the names are split (see :mod:`raven.dns.shards`) and each sink is given the file of
    its shard: ``sinks`` are (label, shard, sink).
    """

    def __init__(self, names: Callable[[], Iterable[str]], addresses: Sequence[str], debounce: float,
                 sinks: Sequence[tuple[str, int, Sink]], ready: Callable[[], bool] | None = None,
                 shards: int = 1, direct: Callable[[], Mapping[str, str]] | None = None) -> None:
        self.names = names
        self.direct = direct or dict
        self.addresses = list(addresses)
        self.debounce = debounce
        self.sinks = list(sinks)
        self.shards = shards
        # Nothing is published before ``ready()``: a restarted gateway knows no nodes until its agents
        # are back, and publishing then would take every edge name out of DNS for a while.
        self.ready = ready or (lambda: True)
        self.content = ""
        self.writes = 0
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._skipped: set[str] = set()
        self._failures = 0

    def changed(self) -> None:
        self._dirty.set()

    def valid_names(self) -> list[str]:
        """The names to publish; any the hosts format cannot carry are left out (logged once each)."""
        out = []
        for name in self.names():
            if wire.valid_node_name(name):
                out.append(name)
            elif name not in self._skipped:
                self._skipped.add(name)
                log.warning("node name %r is not a valid RFC 1123 host name: left out of the hosts file", name[:300])
        return out

    def current(self) -> str:
        """The whole file (every shard's names in one)."""
        return render(self.valid_names(), self.addresses, direct=self.direct())

    def current_shards(self) -> list[str]:
        from raven.dns.shards import render_shards

        return render_shards(self.valid_names(), self.addresses, self.shards, direct=self.direct())

    async def publish_once(self) -> bool:
        """Publish to every sink; False when something failed (and will be retried)."""
        if not self.ready():
            return False
        contents = self.current_shards() if self.shards > 1 else [self.current()]
        self.content = contents[0] if len(contents) == 1 else "".join(contents)
        ok = True
        for label, shard, sink in self.sinks:
            content = contents[shard] if shard < len(contents) else contents[0]
            try:
                if await sink(content):
                    self.writes += 1
                    log.info("published hosts file (%d line(s)) to %s", content.count("\n") - 3, label)
            except Exception as exc:  # retried with backoff
                log.warning("could not publish the hosts file to %s: %s", label, exc)
                ok = False
        return ok

    async def run(self, resync: float = 60.0) -> None:
        """Publish once ready (looked at every second until then), then after every change (debounced), every
        ``resync`` seconds anyway, and with exponential backoff (up to 30 s) while publishing fails."""
        while True:
            self._dirty.clear()
            if not self.ready():
                wait = 1.0  # not a failure: published within a second of becoming ready
            elif await self.publish_once():
                self._failures = 0
                wait = resync
            else:
                self._failures += 1
                wait = min(30.0, self.debounce * 2 ** min(self._failures, 8))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._dirty.wait()
            await asyncio.sleep(self.debounce)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="hosts-publisher")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None


def file_sink(path: Path) -> Sink:
    async def write(content: str) -> bool:
        return await asyncio.to_thread(write_atomic, path, content)

    return write
