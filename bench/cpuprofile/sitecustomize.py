"""A CPU-time stack sampler for a running service, for benchmarks (py-spy is not installed here).

Put this directory first on ``PYTHONPATH`` and set ``RAVEN_CPUPROFILE=/some/prefix`` for the processes to
profile (a benchmark's children inherit both); then ``kill -USR1 <pid>`` starts sampling and ``kill -USR2 <pid>``
stops it and writes ``/some/prefix.<pid>.json``: sample counts per stack, per innermost function and per line.
Read it with ``python bench/cpuprofile/report.py FILE``.

Sampling is driven by ``setitimer(ITIMER_PROF)``, which counts the process's CPU time (user and system): samples
fall in proportion to CPU, not wall time, so waiting in epoll costs nothing and a process that waits for a core
is not charged for it. The handler runs at the next bytecode boundary, so time in C code (uvloop, OpenSSL, the
kernel) is counted in the Python frame that called it or ran next. Without ``RAVEN_CPUPROFILE`` it does nothing.
"""

from __future__ import annotations

import collections
import json
import os
import signal
from types import FrameType

INTERVAL = 0.0005  # seconds of CPU time between samples

_out = os.environ.get("RAVEN_CPUPROFILE")
_stacks: collections.Counter[str] = collections.Counter()


_CWD = os.getcwd() + os.sep


def _name(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename.removeprefix(_CWD).split("site-packages/")[-1].split("python3.11/")[-1]
    return f"{path}:{code.co_name}:{frame.f_lineno}"


def _sample(signum: int, frame: FrameType | None) -> None:
    names = []
    while frame is not None:
        names.append(_name(frame))
        frame = frame.f_back
    _stacks[";".join(reversed(names))] += 1


def _start(signum: int, frame: FrameType | None) -> None:
    _stacks.clear()
    signal.signal(signal.SIGPROF, _sample)
    signal.setitimer(signal.ITIMER_PROF, INTERVAL, INTERVAL)


def _stop(signum: int, frame: FrameType | None) -> None:
    signal.setitimer(signal.ITIMER_PROF, 0, 0)
    with open(f"{_out}.{os.getpid()}.json", "w") as fh:
        json.dump({"stacks": _stacks}, fh)


if _out:
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
