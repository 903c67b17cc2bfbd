"""Forwarding sysctls shared by the Raven processes of one network namespace: set by the first, restored by the last.

``net.ipv4.ip_forward`` and ``net.ipv6.conf.all.forwarding`` belong to the whole network namespace, and two
agents (or a gateway and an agent) may run in one. Each process remembering what *it* changed is wrong both ways:
the one that switched forwarding on would switch it off under another still running, and when it stops first,
the last one (which found forwarding already on) would leave it on after everyone has gone.

So the processes share a record, a small JSON file per network namespace under ``/run/raven`` (tmpfs: gone at
reboot, when the kernel's values are back to their defaults too), written under an exclusive ``flock`` on one lock
file (the kernel drops the lock of a process that dies, so a crash never leaves it held). It holds, per key, the
value found before the first user and the value set, and the users (holders): each with its PID, the start time
of that process (so that a reused PID is not taken for it) and its PID namespace. On every change the holders
whose process is gone (a crash, a SIGKILL) are dropped first; the last holder to leave puts back the value found
before the first, if the key still has the value Raven set (someone else's change is left alone, and logged).
A holder in another PID namespace cannot be checked and is kept (never restore under a process that may run).

Only Raven's processes take part: another tunnel (a VPN) that needs forwarding is protected by the caller, which
keeps forwarding on while other tunnel devices exist (``keep``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from raven.layer3.errors import Layer3Error

log = logging.getLogger("raven.layer3.sysctls")
STATE_DIR = Path("/run/raven")
LOCK_TIMEOUT = 5.0  # seconds to wait for another process's (tiny) critical section


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of /proc/PID/stat), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # fields after "(comm)" start at field 3


def _ns_id(kind: str, pid: int | str = "self") -> str:
    st = os.stat(f"/proc/{pid}/ns/{kind}")
    return f"{st.st_dev}-{st.st_ino}"


class SharedSysctls:
    """One process's share of its network namespace's forwarding sysctls (see the module doc)."""

    def __init__(self, read: Callable[[str], str], write: Callable[[str, str], None], *,
                 state_dir: Path = STATE_DIR, namespace: str | None = None,
                 alive: Callable[[dict[str, Any]], bool] | None = None) -> None:
        self._read = read
        self._write = write
        self.state_dir = state_dir
        self.namespace = namespace or _ns_id("net")
        self._alive = alive or _holder_alive
        self.me: dict[str, Any] = {
            "id": secrets.token_hex(8), "pid": os.getpid(), "start": _proc_start(os.getpid()),
            "pidns": _ns_id("pid"), "keys": [],
        }
        self.holding = False

    @property
    def path(self) -> Path:
        return self.state_dir / f"layer3-sysctls-{self.namespace}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        try:
            self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            lock = os.open(self.state_dir / "layer3-sysctls.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise Layer3Error(f"cannot record the shared forwarding settings in {self.state_dir}: {exc.strerror} "
                              "(or set layer3.manage_sysctls: false and set forwarding yourself)") from None
        try:
            deadline = time.monotonic() + LOCK_TIMEOUT
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise Layer3Error(f"{self.state_dir}/layer3-sysctls.lock is held by another process for "
                                          f"more than {LOCK_TIMEOUT:g}s") from None
                    time.sleep(0.01)
            state = self._load()
            yield state
            self._save(state)
        finally:
            os.close(lock)  # releases the lock

    def _load(self) -> dict[str, Any]:
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"keys": {}, "holders": []}
        except (OSError, ValueError) as exc:
            log.warning("layer3: %s is unreadable (%s): starting a new record", self.path, exc)
            return {"keys": {}, "holders": []}
        if not isinstance(state, dict) or not isinstance(state.get("keys"), dict) \
                or not isinstance(state.get("holders"), list):
            log.warning("layer3: %s is not a record of Raven's: starting a new one", self.path)
            return {"keys": {}, "holders": []}
        return state

    def _save(self, state: dict[str, Any]) -> None:
        if not state["holders"] and not state["keys"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        tmp.replace(self.path)

    def _prune(self, state: dict[str, Any]) -> None:
        """Drop the holders whose process is gone (crashed, killed): they hold nothing any more."""
        kept = []
        for holder in state["holders"]:
            if not isinstance(holder, dict):
                continue
            if holder.get("id") == self.me["id"] or self._alive(holder):
                kept.append(holder)
            else:
                log.info("layer3: Raven process %s that used the forwarding settings is gone", holder.get("pid"))
        state["holders"] = kept

    def acquire(self, wanted: Sequence[tuple[str, str]]) -> None:
        """Set every ``(key, value)`` (recording the value found, if this is its first holder); hold them."""
        with self._locked() as state:
            self._prune(state)
            for key, value in wanted:
                try:
                    now = self._read(key)
                    entry = state["keys"].get(key)
                    if entry is None or not any(key in h.get("keys", ()) for h in state["holders"]):
                        # No live holder: the value found now is the one to put back, unless it is what a holder
                        # that crashed set (then the value found before that holder still is).
                        if entry is None or now != entry.get("set"):
                            entry = {"found": now, "set": value}
                    entry["set"] = value
                    state["keys"][key] = entry
                    if now != value:
                        self._write(key, value)
                        log.info("layer3: set sysctl %s=%s (was %s)", key, value, now)
                except OSError as exc:
                    raise Layer3Error(f"cannot set sysctl {key}={value}: {exc.strerror}") from None
                if key not in self.me["keys"]:
                    self.me["keys"].append(key)
            state["holders"] = [h for h in state["holders"] if h.get("id") != self.me["id"]] + [dict(self.me)]
            self.holding = True

    def release(self, keep: bool = False) -> list[str]:
        """Stop holding; where this was the last holder of a key, put back the value found before the first one
        (``keep``: leave the values as they are, another tunnel still needs them). Returns what was restored."""
        if not self.holding:
            return []
        restored: list[str] = []
        with self._locked() as state:
            self._prune(state)
            state["holders"] = [h for h in state["holders"] if h.get("id") != self.me["id"]]
            self.holding = False
            for key in self.me["keys"]:
                others = [h for h in state["holders"] if key in h.get("keys", ())]
                entry = state["keys"].get(key)
                if others or entry is None:
                    if others:
                        log.info("layer3: sysctl %s left on: %d other Raven process(es) here still use it", key,
                                 len(others))
                    continue
                del state["keys"][key]
                if keep:
                    log.info("layer3: sysctl %s=%s left on: another tunnel device in this namespace still needs it",
                             key, entry.get("set"))
                    continue
                try:
                    now = self._read(key)
                    if now != entry.get("set"):
                        log.info("layer3: sysctl %s is %s, not the %s Raven set: left alone", key, now,
                                 entry.get("set"))
                        continue
                    if now != entry["found"]:
                        self._write(key, str(entry["found"]))
                        restored.append(f"{key}={entry['found']}")
                        log.info("layer3: restored sysctl %s=%s", key, entry["found"])
                except OSError as exc:
                    log.warning("layer3: could not restore sysctl %s=%s: %s", key, entry.get("found"), exc.strerror)
        return restored


def _holder_alive(holder: dict[str, Any]) -> bool:
    """Whether a holder's process still runs (a holder in another PID namespace cannot be checked: yes)."""
    try:
        if holder.get("pidns") != _ns_id("pid"):
            return True
        pid = int(holder["pid"])
    except (KeyError, TypeError, ValueError, OSError):
        return False
    start = _proc_start(pid)
    return start is not None and start == holder.get("start")
