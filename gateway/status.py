"""What a platform team wants to see at a glance: this replica, its pools and agents, every node's last scrape.

:func:`snapshot` builds one JSON-able picture from the registry and the proxy (``/status`` on the ops port,
``raven status``); :func:`render_html` turns it into a self-contained page (``/status.html``: no external
assets, so it works air-gapped; it refreshes itself).
"""

from __future__ import annotations

import html
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.registry import Registry
from raven import version
from raven.logsafe import escape
from raven.protocol import wire
from raven.protocol.state import SessionState

if TYPE_CHECKING:
    from gateway.pools import Pools


@dataclass(slots=True)
class NodeResult:
    """The outcome of the latest request for one node, as the client saw it."""

    at: float  # wall clock
    code: str  # HTTP status sent, or broken-502, client-gone, ...
    reason: str  # empty when it worked


def snapshot(
    *,
    replica: str,
    replicas: int,
    started: float,
    ready: tuple[bool, str],
    draining: bool,
    registry: Registry,
    last: Mapping[str, NodeResult],
    now: float | None = None,
    pools: Pools | None = None,
) -> dict[str, Any]:
    """``pools``: how each pool is reached; every pool then says its ``reach`` (and where that came from), and the
    nodes of direct and layer3 pools are listed too, without agents (they need none)."""
    now = time.time() if now is None else now
    reach = pools.reach if pools is not None else (lambda pool: "tunnel")
    source = pools.source if pools is not None else (lambda pool: "default")

    def pool_row(name: str) -> dict[str, Any]:
        return {"pool": name, "reach": reach(name), "reach_from": source(name), "agents": [], "nodes": 0,
                "reachable": 0}

    out: dict[str, dict[str, Any]] = {name: pool_row(name) for name in (pools.configured_pools() if pools else ())}
    for sess in sorted(registry.sessions.values(), key=lambda x: (x.agent, x.session_id)):
        for name in sorted(sess.pools):
            entry = out.get(name) or out.setdefault(name, pool_row(name))
            entry["agents"].append({
                "agent": sess.agent,
                "session": sess.session_id[:8],
                "peer": sess.peer,
                "age_seconds": round(max(0.0, now - sess.connected_at), 1),
                "streams": sess.session.in_flight,
                "draining": sess.session.state is SessionState.DRAINING,
                "nodes": len(sess.nodes),
                # The agent's release (None: it announced none, so it is 0.1.0) and the protocol agreed with it.
                "version": sess.release or None,
                "protocol": sess.session.core.version,
                # Its latest registration's refusals (a node of another pool, a reserved name ...): the count
                # and the first few, each with its reason. The agent chose the names: escaped for a terminal.
                "refused": sess.refused_count,
                "refused_nodes": [{"node": escape(node[:253]), "reason": r.label, "text": escape(r.text)}
                                  for node, r in sess.refused_sample],
            })
    nodes = []
    direct = {n.name: n for n in pools.direct_nodes(registry.known_nodes())} if pools is not None else {}
    for e in registry.known_nodes():
        if e.name in direct:
            continue
        pool = out.get(e.pool) or out.setdefault(e.pool, pool_row(e.pool))
        pool["nodes"] += 1
        pool["reachable"] += 1 if e.sessions else 0
        result = last.get(e.name)
        nodes.append({
            "name": e.name,
            "pool": e.pool,
            "reach": pool["reach"],
            "agents": sorted({s.agent for s in e.sessions}),
            "last": None if result is None else {
                "seconds_ago": round(max(0.0, now - result.at), 1), "code": result.code, "reason": result.reason,
            },
        })
    for d in direct.values():
        pool = out.get(d.pool) or out.setdefault(d.pool, pool_row(d.pool))
        pool["nodes"] += 1
        pool["reachable"] += 1  # Raven is not in the way: Prometheus reaches it (or not) by itself
        nodes.append({"name": d.name, "pool": d.pool, "reach": d.reach, "agents": [], "last": None})
    nodes.sort(key=lambda n: n["name"])
    return {
        "replica": replica,
        "replicas": replicas,
        "version": version.RELEASE,
        "protocols": list(wire.SUPPORTED_VERSIONS),
        "uptime_seconds": round(max(0.0, now - started), 1),
        "ready": ready[0],
        "ready_reason": ready[1],
        "draining": draining,
        "pools": [out[name] for name in sorted(out)],
        "nodes": nodes,
    }


def _e(value: object) -> str:
    """For the page: control characters as visible escapes (raven/logsafe.py's rule), then HTML-escaped."""
    return html.escape(escape(str(value)), quote=True)


def _ok(code: str) -> bool:
    return code.isdigit() and 200 <= int(code) < 400


def render_html(snap: Mapping[str, Any], refresh: int = 5) -> str:
    """The status page: plain HTML and inline CSS, readable on a laptop screen."""
    rows_pools = []
    for p in snap["pools"]:
        agents = p["agents"]
        reach = p.get("reach", "tunnel")
        state = "ok" if agents and p["reachable"] == p["nodes"] else ("bad" if not agents else "warn")
        if reach != "tunnel":
            state = "direct"  # scraped without the proxy: no agent is needed, none missing is a fault
        agent_lines = "".join(
            f"<div>{_e(a['agent'])} <span class=dim>{_e(_release(a))}, session {_e(a['session'])}, "
            f"{_fmt_age(a['age_seconds'])}, "
            f"{a['streams']} stream(s){', draining' if a['draining'] else ''}</span>{_refused_html(a)}</div>"
            for a in agents
        ) or ("<div class=dim>none needed: Prometheus scrapes this pool without the proxy</div>" if reach != "tunnel"
              else "<div class=bad>no agent connected</div>")
        reached = "through the tunnel" if reach == "tunnel" else "over layer 3" if reach == "layer3" else "directly"
        rows_pools.append(f"<tr class={state}><td>{_e(p['pool'])}</td><td>{_e(reach)} <span class=dim>"
                          f"({_e(reached)}; from {_e(p.get('reach_from', 'default'))})</span></td><td>{agent_lines}"
                          f"</td><td>{p['reachable']} / {p['nodes']}</td></tr>")
    rows_nodes = []
    for n in snap["nodes"]:
        last = n["last"]
        if last is None:
            cls, result = "dim", "not scraped yet"
        else:
            cls = "ok" if _ok(last["code"]) else "bad"
            result = f"{_e(last['code'])} {_fmt_age(last['seconds_ago'])} ago"
            if last["reason"]:
                result += f"<div class=reason>{_e(last['reason'])}</div>"
        direct = n.get("reach", "tunnel") != "tunnel"
        if direct and last is None:
            way = "over layer 3" if n["reach"] == "layer3" else "directly"
            cls, result = "direct", f"scraped {way}, not through Raven"
        agents = ", ".join(_e(a) for a in n["agents"]) or ("-" if direct else "<span class=bad>none</span>")
        rows_nodes.append(f"<tr class={cls}><td>{_e(n['name'])}</td><td>{_e(n['pool'])}</td>"
                          f"<td>{_e(n.get('reach', 'tunnel'))}</td><td>{agents}</td><td>{result}</td></tr>")
    ready = "ready" if snap["ready"] else "not ready"
    layer3 = _layer3_html(snap.get("layer3"))
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><meta http-equiv=refresh content="{refresh}">
<meta name=viewport content="width=device-width, initial-scale=1">
<title>Raven gateway {_e(snap['replica'])}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.3em; margin: 0 0 .2em; }} h2 {{ font-size: 1.1em; margin: 1.4em 0 .4em; }}
table {{ border-collapse: collapse; width: 100%; max-width: 70em; }}
th, td {{ text-align: left; padding: .35em .6em; border-bottom: 1px solid #ddd; vertical-align: top; }}
th {{ background: #f3f3f3; }} .dim {{ color: #777; }} .reason {{ color: #a00; font-size: .92em; }}
tr.ok td:first-child {{ border-left: 4px solid #2a2; }} tr.warn td:first-child {{ border-left: 4px solid #d90; }}
tr.bad td:first-child {{ border-left: 4px solid #c22; }}
tr.direct td:first-child {{ border-left: 4px solid #58c; }} div.bad, span.bad {{ color: #c22; }}
</style></head><body>
<h1>Raven gateway {_e(snap['replica'])}</h1>
<div class=dim>{_e(_gateway_release(snap))} &middot;
replica of {snap['replicas']} &middot; up {_fmt_age(snap['uptime_seconds'])} &middot;
{_e(ready)}: {_e(snap['ready_reason'])}{' &middot; draining' if snap['draining'] else ''} &middot;
refreshes every {refresh}s</div>
<h2>Pools</h2>
<table><tr><th>pool</th><th>reach</th><th>agents (sessions to this replica)</th><th>nodes reachable</th></tr>
{''.join(rows_pools) or '<tr><td colspan=4 class=dim>no pools yet</td></tr>'}</table>
<h2>Nodes</h2>
<table><tr><th>node</th><th>pool</th><th>reach</th><th>agents</th><th>last scrape through this replica</th></tr>
{''.join(rows_nodes) or '<tr><td colspan=5 class=dim>no nodes yet</td></tr>'}</table>
{layer3}
</body></html>
"""


def _layer3_html(l3: Mapping[str, Any] | None) -> str:
    """Layer 3's part of the page: per pool, the agent that carries it and what is routed (nothing when off)."""
    if not l3:
        return ""
    rows = []
    for pool, p in l3["pools"].items():
        active = _e(p["active"]) if p["active"] else "<span class=bad>no agent: not routed</span>"
        standby = ", ".join(_e(c) for c in p["candidates"] if c != p["active"]) or "none"
        rows.append(f"<tr class={'ok' if p['active'] else 'bad'}><td>{_e(pool)}</td><td>{active}</td>"
                    f"<td>{_e(', '.join(p['routed'])) or '-'}</td><td>{standby}</td></tr>")
    return (f"<h2>Layer 3 (device {_e(l3['device'])})</h2>\n<table><tr><th>pool</th><th>active agent</th>"
            f"<th>routed CIDRs</th><th>standby</th></tr>\n{''.join(rows)}</table>")


def _refused_html(agent: Mapping[str, Any]) -> str:
    """What the agent's latest registration had refused (nothing when all was accepted)."""
    if not agent.get("refused"):
        return ""
    shown = "; ".join(f"{n['node']}: {n['text']}" for n in agent.get("refused_nodes", ()))
    return f"<div class=reason>{agent['refused']} node(s) refused, e.g. {_e(shown)}</div>"


def _release(agent: Mapping[str, Any]) -> str:
    """An agent's release and protocol for people: ``0.2.0, protocol 2``."""
    return f"{version.peer_release(agent.get('version') or '')}, protocol {agent.get('protocol', '?')}"


def _gateway_release(snap: Mapping[str, Any]) -> str:
    """The gateway's release and protocols; a 0.1.0 gateway's snapshot (``raven status`` of a newer release
    reading an older gateway) has neither."""
    if "version" not in snap:
        return f"release {version.peer_release('')}"
    return f"release {snap['version']}, tunnel protocol {','.join(str(v) for v in snap.get('protocols', ()))}"


def _fmt_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def render_text(snap: Mapping[str, Any]) -> str:
    """The same as plain-text tables, for ``raven status``."""
    out = [escape(f"gateway {snap['replica']} (replica of {snap['replicas']}, {_gateway_release(snap)}), "
                  f"up {_fmt_age(snap['uptime_seconds'])}, "
                  f"{'ready' if snap['ready'] else 'NOT READY'}: {snap['ready_reason']}"
                  f"{', draining' if snap['draining'] else ''}"), ""]
    rows: list[tuple[str, ...]] = [("POOL", "REACH", "AGENT", "VERSION", "PROTO", "SESSION", "AGE", "STREAMS",
                                    "STATE", "NODES")]
    for p in snap["pools"]:
        reach = p.get("reach", "tunnel")
        if not p["agents"]:
            state = "NO AGENT" if reach == "tunnel" else "no agent needed"
            rows.append((p["pool"], reach, "-", "-", "-", "-", "-", "-", state, f"{p['reachable']}/{p['nodes']}"))
        for a in p["agents"]:
            release = a.get("version") or f"<={version.UNANNOUNCED}"
            rows.append((p["pool"], reach, a["agent"], release, str(a.get("protocol", "?")), a["session"],
                         _fmt_age(a["age_seconds"]), str(a["streams"]),
                         "draining" if a["draining"] else "up", f"{p['reachable']}/{p['nodes']}"))
    out += [*_table(rows), ""]
    # Once per session (a session of several pools is listed under each).
    refused = {(a["agent"], a["session"]): a for p in snap["pools"] for a in p["agents"] if a.get("refused")}
    for a in refused.values():
        out.append(f"agent {a['agent']} (session {a['session']}): {a['refused']} node(s) refused")
        out += [f"  {n['node']}: {n['text']}" for n in a.get("refused_nodes", ())]
    if refused:
        out.append("")
    rows = [("NODE", "POOL", "REACH", "AGENTS", "LAST", "AGO", "ERROR")]
    for n in snap["nodes"]:
        reach = n.get("reach", "tunnel")
        last = n["last"] or {"code": "-", "seconds_ago": None, "reason": ""}
        ago = "-" if last["seconds_ago"] is None else _fmt_age(last["seconds_ago"])
        agents = ",".join(n["agents"]) or ("NONE" if reach == "tunnel" else "-")
        rows.append((n["name"], n["pool"], reach, agents, last["code"], ago, last["reason"]))
    out += _table(rows)
    l3 = snap.get("layer3")
    if l3:
        rows = [("LAYER3 POOL", "ACTIVE AGENT", "ROUTED", "STANDBY")]
        for pool, p in l3["pools"].items():
            rows.append((pool, p["active"] or "NONE (not routed)", ",".join(p["routed"]) or "-",
                         ",".join(c for c in p["candidates"] if c != p["active"]) or "-"))
        out += ["", escape(f"layer 3 on device {l3['device']}"), *_table(rows)]
    return "\n".join(out) + "\n"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Aligned columns. Every cell is escaped (raven/logsafe.py's rule), whatever the snapshot holds: a newline
    in a cell cannot forge a row, nor an escape sequence drive the terminal."""
    rows = [tuple(escape(str(cell)) for cell in row) for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
