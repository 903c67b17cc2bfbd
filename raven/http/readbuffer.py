"""The read buffer that all guarded connections of one thread share (raven/http/guard.py reads into it)."""

from __future__ import annotations

import threading

__all__ = ["READ_BUFFER", "read_buffer"]

READ_BUFFER = 124 * 1024  # under the services' 128 KiB mmap threshold: the copy of a full read stays on the heap


class _ReadBuffer(threading.local):
    """One read buffer per thread (each event loop runs in one), shared by all its guarded connections.

    The event loop fills it and calls ``buffer_updated`` at once, which copies the bytes out before anything
    else can run on that loop, so one buffer serves every connection. Taking TLS connections' bytes this way
    matters: given a plain protocol, uvloop's TLS layer allocates a fresh 256 KiB block for every TLS record it
    decrypts (one mmap, mremap and munmap each, with their page faults and TLB flushes, under the mmap
    threshold the services set) and then joins the records, another copy; this way it decrypts straight into
    this buffer.
    """

    def __init__(self) -> None:
        self.view = memoryview(bytearray(READ_BUFFER))


read_buffer = _ReadBuffer()
