"""Run a command to its end with a deadline; the process is killed and reaped on every path (timeout, cancel)."""

from __future__ import annotations

import asyncio


async def run_to_end(*cmd: str, timeout: float = 60.0) -> tuple[int, bytes, bytes]:
    """(exit status, stdout, stderr) of ``cmd``, its standard input closed; ``TimeoutError`` after ``timeout``."""
    proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return int(proc.returncode or 0), out, err
