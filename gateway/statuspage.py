"""The status (gateway/status.py) for people: a self-contained web page (``/status.html``: no external assets, so
it works air-gapped; it refreshes itself) and plain-text tables (``raven status``).

Both open on the summary per pool, then list the nodes that need attention first, one page of them, with how many
more match and how to see them (the page's filter form and links, ``raven status --state/--pool/--node/--offset``).
Every value that a peer chose (agent and node names, reasons) is escaped: control characters as visible escapes
(raven/logsafe.py's rule) on the page and in every cell of the tables, then ``html.escape`` on the page.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from gateway.status import MAX_POOLS_SHOWN, STATES, succeeded
from raven import version
from raven.logsafe import escape


def _e(value: object) -> str:
    """For the page: control characters as visible escapes (raven/logsafe.py's rule), then HTML-escaped."""
    return html.escape(escape(str(value)), quote=True)


def _fmt_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _release(agent: Mapping[str, Any]) -> str:
    """An agent's release and protocol for people: ``0.2.0, protocol 2``."""
    return f"{version.peer_release(agent.get('version') or '')}, protocol {agent.get('protocol', '?')}"


def _gateway_release(snap: Mapping[str, Any]) -> str:
    """The gateway's release and protocols; a 0.1.0 gateway's snapshot (``raven status`` of a newer release
    reading an older gateway) has neither."""
    if "version" not in snap:
        return f"release {version.peer_release('')}"
    return f"release {snap['version']}, tunnel protocol {','.join(str(v) for v in snap.get('protocols', ()))}"


def _link(params: list[tuple[str, str]], **change: Any) -> str:
    """``?...`` with ``params`` changed: a value None removes the parameter, a list repeats it."""
    keep = [(k, v) for k, v in params if k not in change]
    for key, value in change.items():
        if value is None:
            continue
        keep += [(key, str(v)) for v in value] if isinstance(value, list) else [(key, str(value))]
    return f'"{_e("?" + urlencode(keep))}"' if keep else '"?"'


def _params(snap: Mapping[str, Any]) -> list[tuple[str, str]]:
    f = snap.get("filter") or {}
    out = [("pool", p) for p in f.get("pool", [])] + ([("q", f["q"])] if f.get("q") else [])
    out += [("state", s) for s in f.get("state", [])]
    if snap.get("limit") not in (None, 50):
        out.append(("limit", str(snap["limit"])))
    return out


def _pool_rows(snap: Mapping[str, Any], params: list[tuple[str, str]]) -> str:
    rows = []
    for p in snap["pools"][:MAX_POOLS_SHOWN]:
        agents, reach = p["agents"], p.get("reach", "tunnel")
        failing = p.get("failing", 0)
        state = ("ok" if agents and p["reachable"] == p["nodes"] and not failing else
                 "bad" if not agents or failing else "warn")
        if reach != "tunnel":
            state = "direct"  # scraped without the proxy: no agent is needed, none missing is a fault
        agent_lines = "".join(
            f"<div>{_e(a['agent'])} <span class=dim>{_e(_release(a))}, session {_e(a['session'])}, "
            f"{_fmt_age(a['age_seconds'])}, {a['streams']} stream(s){', draining' if a['draining'] else ''}</span>"
            f"{_refused_html(a)}</div>" for a in agents
        ) or ("<div class=dim>none needed: Prometheus scrapes this pool without the proxy</div>" if reach != "tunnel"
              else "<div class=bad>no agent connected</div>")
        reached = "through the tunnel" if reach == "tunnel" else "over layer 3" if reach == "layer3" else "directly"
        err = p.get("last_error")
        last_error = (f"<a href={_link([], pool=p['pool'], state='failing')}>{failing} failing</a>"
                      f"<div class=reason>{_e(err['node'])}: {_e(err['code'])} {_fmt_age(err['seconds_ago'])} ago"
                      f"{': ' + _e(err['reason']) if err['reason'] else ''}</div>" if err else
                      f"{failing} failing" if failing else "<span class=dim>none</span>")
        backlog = p.get("backlog")
        if backlog and backlog.get("scrapes"):
            agent_lines += f"<div class=warn>backlog: {_backlog(backlog)}</div>"
        refused = p.get("refused", 0)
        if refused:
            last_error += f"<div><a href={_link([], pool=p['pool'], state='refused')}>{refused} refused</a></div>"
        rows.append(f"<tr class={state}><td><a href={_link(params, pool=p['pool'], offset=None)}>{_e(p['pool'])}</a>"
                    f"</td><td>{_e(reach)} <span class=dim>({_e(reached)}; from {_e(p.get('reach_from', 'default'))})"
                    f"</span></td><td>{agent_lines}</td><td>{p['reachable']} / {p['nodes']}</td><td>{last_error}</td>"
                    "</tr>")
    more = len(snap["pools"]) - MAX_POOLS_SHOWN
    if more > 0:
        rows.append(f"<tr><td colspan=5 class=dim>and {more} more pools: filter by pool, or see /status</td></tr>")
    return "".join(rows) or "<tr><td colspan=5 class=dim>no pools yet</td></tr>"


def _refused_html(agent: Mapping[str, Any]) -> str:
    """What the agent's latest registration had refused (nothing when all was accepted)."""
    if not agent.get("refused"):
        return ""
    shown = "; ".join(f"{n['node']}: {n['text']}" for n in agent.get("refused_nodes", ()))
    return f"<div class=reason>{agent['refused']} node(s) refused, e.g. {_e(shown)}</div>"


def _node_rows(snap: Mapping[str, Any]) -> str:
    rows = []
    for n in snap["nodes"]:
        last, state = n["last"], n.get("state", "")
        refused = n.get("refused")
        if refused:
            cls = "bad"
            result = (f"refused {_fmt_age(refused['seconds_ago'])} ago (agent {_e(refused['agent'])})"
                      f"<div class=reason>{_e(refused['reason'])}</div>")
        elif last is None:
            cls, result = "dim", "not scraped yet"
        else:
            cls = "ok" if succeeded(last["code"]) else "bad"
            result = f"{_e(last['code'])} {_fmt_age(last['seconds_ago'])} ago"
            if last["reason"]:
                result += f"<div class=reason>{_e(last['reason'])}</div>"
        direct = n.get("reach", "tunnel") != "tunnel"
        if direct and last is None and not refused:
            way = "over layer 3" if n["reach"] == "layer3" else "directly"
            cls, result = "direct", f"scraped {way}, not through Raven"
        if state == "unreachable":
            cls = "warn"
        agents = ", ".join(_e(a) for a in n["agents"]) or ("-" if direct else "<span class=bad>none</span>")
        rows.append(f"<tr class={cls}><td>{_e(n['name'])}</td><td>{_e(n['pool'])}</td><td>{_e(state)}</td>"
                    f"<td>{_e(n.get('reach', 'tunnel'))}</td><td>{agents}</td><td>{result}</td></tr>")
    return "".join(rows) or "<tr><td colspan=6 class=dim>no nodes match</td></tr>"


def _pager(snap: Mapping[str, Any], params: list[tuple[str, str]]) -> str:
    shown, matched = len(snap["nodes"]), snap.get("matched", len(snap["nodes"]))
    offset, limit = snap.get("offset", 0), snap.get("limit", shown) or 1
    parts = [f"nodes {offset + 1 if shown else 0}-{offset + shown} of {matched} matching"]
    if offset > 0:
        parts.append(f"<a href={_link(params, offset=max(0, offset - limit) or None)}>previous {limit}</a>")
    if offset + shown < matched:
        parts.append(f"{matched - offset - shown} more: <a href={_link(params, offset=offset + limit)}>next "
                     f"{limit}</a>")
    return " &middot; ".join(parts)


def _filters(snap: Mapping[str, Any], params: list[tuple[str, str]]) -> str:
    f = snap.get("filter") or {}
    counts = snap.get("states") or {}
    chosen = f.get("state", [])
    links = " ".join(
        f"<a class=st-{s} href={_link([p for p in params if p[0] != 'state'], state=s, offset=None)}>"
        f"{'<b>' if s in chosen else ''}{_e(s)} {counts.get(s, 0)}{'</b>' if s in chosen else ''}</a>" for s in STATES)
    pools = "".join(f"<input type=hidden name=pool value=\"{_e(p)}\">" for p in f.get("pool", []))
    states = "".join(f"<input type=hidden name=state value=\"{_e(s)}\">" for s in f.get("state", []))
    scope = (f"pool {_e(', '.join(f['pool']))} &middot; " if f.get("pool") else "") + (
        f"name has {_e(f['q'])!s} &middot; " if f.get("q") else "")
    return (f"<form method=get class=filters>{pools}{states}<input name=q placeholder=\"node name (a part)\" "
            f"value=\"{_e(f.get('q', ''))}\" size=24> <button>find</button> <a href='?'>all nodes</a></form>"
            f"<div>{scope}by state: {links}</div>")


def render_html(snap: Mapping[str, Any], refresh: int = 5) -> str:
    """The status page: plain HTML and inline CSS, readable on a laptop screen."""
    params = _params(snap)
    ready = "ready" if snap["ready"] else "not ready"
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><meta http-equiv=refresh content="{refresh}">
<meta name=viewport content="width=device-width, initial-scale=1">
<title>Raven gateway {_e(snap['replica'])}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.3em; margin: 0 0 .2em; }} h2 {{ font-size: 1.1em; margin: 1.4em 0 .4em; }}
table {{ border-collapse: collapse; width: 100%; max-width: 80em; }}
th, td {{ text-align: left; padding: .35em .6em; border-bottom: 1px solid #ddd; vertical-align: top; }}
th {{ background: #f3f3f3; }} .dim {{ color: #777; }} .reason {{ color: #a00; font-size: .92em; }}
tr.ok td:first-child {{ border-left: 4px solid #2a2; }} tr.warn td:first-child {{ border-left: 4px solid #d90; }}
tr.bad td:first-child {{ border-left: 4px solid #c22; }}
tr.direct td:first-child {{ border-left: 4px solid #58c; }} div.bad, span.bad {{ color: #c22; }}
a {{ color: #246; }} .filters {{ margin: .3em 0; }} .st-failing, .st-refused {{ color: #c22; }}
.st-unreachable {{ color: #b70; }} .pager {{ margin: .5em 0; color: #555; }} td:first-child {{ white-space: nowrap; }}
</style></head><body>
<h1>Raven gateway {_e(snap['replica'])}</h1>
<div class=dim>{_e(_gateway_release(snap))} &middot;
replica of {snap['replicas']} &middot; up {_fmt_age(snap['uptime_seconds'])} &middot;
{_e(ready)}: {_e(snap['ready_reason'])}{' &middot; draining' if snap['draining'] else ''} &middot;
refreshes every {refresh}s</div>
<h2>Pools</h2>
<table><tr><th>pool</th><th>reach</th><th>agents (sessions to this replica)</th><th>nodes reachable</th>
<th>scrapes failing now, latest error</th></tr>
{_pool_rows(snap, params)}</table>
<h2>Nodes (those that need attention first)</h2>
{_filters(snap, params)}
<div class=pager>{_pager(snap, params)}</div>
<table><tr><th>node</th><th>pool</th><th>state</th><th>reach</th><th>agents</th>
<th>last scrape through this replica</th></tr>
{_node_rows(snap)}</table>
<div class=pager>{_pager(snap, params)}</div>
{_layer3_html(snap.get("layer3"))}
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


def _backlog(b: Mapping[str, Any]) -> str:
    return f"{b.get('minutes', 0):.1f} min, {b.get('bytes', 0) / 1e6:.1f} MB ({b.get('scrapes', 0)} scrapes)"


def render_text(snap: Mapping[str, Any]) -> str:
    """The same as plain-text tables, for ``raven status``; reads a gateway of any release's ``/status``."""
    out = [escape(f"gateway {snap['replica']} (replica of {snap['replicas']}, {_gateway_release(snap)}), "
                  f"up {_fmt_age(snap['uptime_seconds'])}, "
                  f"{'ready' if snap['ready'] else 'NOT READY'}: {snap['ready_reason']}"
                  f"{', draining' if snap['draining'] else ''}"), ""]
    rows: list[tuple[str, ...]] = [("POOL", "REACH", "AGENT", "VERSION", "PROTO", "SESSION", "AGE", "STREAMS",
                                    "STATE", "NODES", "FAILING", "LATEST ERROR")]
    for p in snap["pools"]:
        reach = p.get("reach", "tunnel")
        err = p.get("last_error")
        failing = str(p.get("failing", "-"))
        latest = (f"{err['node']}: {err['code']} {_fmt_age(err['seconds_ago'])} ago {err['reason']}".rstrip()
                  if err else "-")
        reachable = f"{p['reachable']}/{p['nodes']}"
        if not p["agents"]:
            state = "NO AGENT" if reach == "tunnel" else "no agent needed"
            rows.append((p["pool"], reach, "-", "-", "-", "-", "-", "-", state, reachable, failing, latest))
        for i, a in enumerate(p["agents"]):
            release = a.get("version") or f"<={version.UNANNOUNCED}"
            rows.append((p["pool"], reach, a["agent"], release, str(a.get("protocol", "?")), a["session"],
                         _fmt_age(a["age_seconds"]), str(a["streams"]), "draining" if a["draining"] else "up",
                         reachable, failing if i == 0 else "", latest if i == 0 else ""))
    out += [*_table(rows), ""]
    backlogs = [(p["pool"], p["backlog"]) for p in snap["pools"] if p.get("backlog", {}).get("scrapes")]
    out += [escape(f"pool {name}: backlog of {_backlog(b)} from an outage, being written") for name, b in backlogs]
    if snap.get("backfill_off"):
        backlogs.append(("", {}))
        out.append(escape(f"backfill is off: {snap['backfill_off']}"))
    if backlogs:
        out.append("")
    # Once per session (a session of several pools is listed under each).
    refused = {(a["agent"], a["session"]): a for p in snap["pools"] for a in p["agents"] if a.get("refused")}
    for a in refused.values():
        out.append(escape(f"agent {a['agent']} (session {a['session']}): {a['refused']} node(s) refused"))
        out += [escape(f"  {n['node']}: {n['text']}") for n in a.get("refused_nodes", ())]
    if refused:
        out.append("")
    counts = snap.get("states")
    if counts:
        out += ["nodes by state: " + ", ".join(f"{s} {counts.get(s, 0)}" for s in STATES), ""]
    rows = [("NODE", "POOL", "STATE", "REACH", "AGENTS", "LAST", "AGO", "ERROR")]
    for n in snap["nodes"]:
        reach = n.get("reach", "tunnel")
        last = n["last"] or {"code": "-", "seconds_ago": None, "reason": ""}
        refused = n.get("refused")
        if refused:
            last = {"code": "refused", "seconds_ago": refused["seconds_ago"], "reason": refused["reason"]}
        ago = "-" if last["seconds_ago"] is None else _fmt_age(last["seconds_ago"])
        agents = ",".join(n["agents"]) or ("NONE" if reach == "tunnel" else "-")
        rows.append((n["name"], n["pool"], n.get("state", "-"), reach, agents, last["code"], ago, last["reason"]))
    out += _table(rows)
    matched, offset = snap.get("matched", len(snap["nodes"])), snap.get("offset", 0)
    rest = matched - offset - len(snap["nodes"])
    if rest > 0:
        out.append(f"... and {rest} more (--offset {offset + len(snap['nodes'])}; narrow with --state, --pool, "
                   "--node)")
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
