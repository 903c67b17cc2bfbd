"""Print a profile written by bench/cpuprofile/sitecustomize.py: the top functions (self and inclusive), the top
lines, and the CPU share of the gateway's components.

    python bench/cpuprofile/report.py /tmp/gw.1234.json [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import json

# The component a frame belongs to, by the start of its file's path (first match wins). A frame of none of
# these (dataclass __init__, enum, functools) is counted in its caller's component.
_COMPONENTS = (
    (("aiohttp/_websocket", "aiohttp/web_ws", "ssl.py", "raven/transport/websocket"),
     "WebSocket frames and TLS (uvloop's SSL layer counted here)"),
    (("aiohttp/", "yarl/", "multidict/", "propcache/"), "aiohttp's HTTP server"),
    (("raven/protocol",), "tunnel protocol core"),
    (("raven/transport/tunnel", "raven/transport/stream"), "session and streams (asyncio layer)"),
    (("raven/http/guard",), "connection guard"),
    (("gateway/", "agent/"), "the service's own request logic"),
    (("prometheus_client",), "prometheus-client"),
    (("asyncio/", "_weakrefset", "contextvars"), "asyncio"),
)
_TRANSPARENT = ("<string>", "dataclasses", "enum", "functools")


def component(frame: str) -> str | None:
    path = frame.split(":", 1)[0]
    if path.startswith(_TRANSPARENT):
        return None
    for prefixes, name in _COMPONENTS:
        if path.startswith(prefixes):
            return name
    return "other: " + path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.file) as fh:
        stacks: dict[str, int] = json.load(fh)["stacks"]
    total = sum(stacks.values())
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    lines: collections.Counter[str] = collections.Counter()
    parts: collections.Counter[str] = collections.Counter()
    for stack, n in stacks.items():
        frames = stack.split(";")
        lines[frames[-1]] += n
        own[frames[-1].rsplit(":", 1)[0]] += n
        for func in {f.rsplit(":", 1)[0] for f in frames}:
            inclusive[func] += n
        part = next((c for c in map(component, reversed(frames)) if c is not None), "other")
        parts[part] += n
    print(f"{total} samples")
    for title, counts in (("components", parts), ("self", own), ("inclusive", inclusive), ("lines", lines)):
        print(f"== {title}")
        for name, n in counts.most_common(args.top):
            print(f"{n / total * 100:6.1f}%  {name}")


if __name__ == "__main__":
    main()
