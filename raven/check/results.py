"""One check's outcome (:class:`Result`) and how a list of them is shown: a line each with ✔/✘ and, under each
✘, what to run; or JSON for CI. The exit status is 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from raven.logsafe import escape as _scrub

OK_MARK = "✔"
FAIL_MARK = "✘"


@dataclass(frozen=True)
class Result:
    check: str  # a short stable id, e.g. "coredns-corefile"
    ok: bool
    detail: str  # what was found
    fix: str = ""  # for a failure: what to run or change


def passed(check: str, detail: str) -> Result:
    return Result(check, True, detail)


def failed(check: str, detail: str, fix: str) -> Result:
    return Result(check, False, detail, fix)


def render_text(results: Sequence[Result]) -> str:
    lines = []
    width = max((len(r.check) for r in results), default=0)
    for r in results:
        lines.append(f"{OK_MARK if r.ok else FAIL_MARK} {r.check:<{width}}  {_scrub(r.detail)}")
        if not r.ok and r.fix:
            lines.extend(f"    fix: {_scrub(line)}" if i == 0 else f"         {_scrub(line)}"
                         for i, line in enumerate(r.fix.splitlines()))
    bad = sum(not r.ok for r in results)
    lines.append(f"{len(results) - bad} of {len(results)} checks passed" + ("" if not bad else f"; {bad} failed"))
    return "\n".join(lines) + "\n"


def render_json(results: Sequence[Result]) -> str:
    return json.dumps({"ok": all(r.ok for r in results), "checks": [asdict(r) for r in results]}, indent=2) + "\n"


def exit_status(results: Sequence[Result]) -> int:
    return 0 if all(r.ok for r in results) else 1
