"""Running a few system calls inside a named network namespace (``ip netns`` names, /run/netns/NAME).

A TUN device is created in the namespace of the thread that opens /dev/net/tun, and /proc/sys/net shows the
namespace of the thread that opens it. :func:`call_in` runs a function in a new, short-lived thread that first
joins the namespace (``setns``); the thread ends afterwards, so no thread of the process is ever left in another
namespace and the caller's thread never moves. File descriptors opened there stay valid everywhere.
With ``netns=None`` the function runs in the calling thread, in the process's own namespace.

Python 3.11 has no ``os.setns``; libc's is called through ctypes.

What is here: entering a namespace for a call, and the check of a namespace's path.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")

_libc = ctypes.CDLL(None, use_errno=True)


def path(netns: str) -> Path:
    """The file of an ``ip netns`` namespace; a name with '/' or a leading '.' is refused."""
    if not netns or "/" in netns or netns.startswith("."):
        raise ValueError(f"{netns!r} is not a network namespace name")
    return NETNS_DIR / netns


def _setns(netns: str) -> None:
    fd = os.open(path(netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {netns!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def call_in(netns: str | None, fn: Callable[[], T]) -> T:
    """Run ``fn()`` in network namespace ``netns`` (None: here) and return its result or raise its error."""
    if netns is None:
        return fn()
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            _setns(netns)
            result.append(fn())
        except BaseException as exc:  # handed to the caller below
            error.append(exc)

    thread = threading.Thread(target=target, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
