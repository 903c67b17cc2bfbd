"""A fake Kubernetes API server (aiohttp, plain HTTP on loopback) speaking the subset raven.kube uses.

- ``GET /api/v1/nodes``: LIST (``labelSelector``) and WATCH (``watch``, ``resourceVersion``, ``allowWatchBookmarks``,
  ``timeoutSeconds``) replaying an event log from a global resourceVersion counter; a resourceVersion older than the
  compacted history gets an ERROR event with a 410 Status. Objects that leave (enter) a watch's label selector are
  sent as DELETED (ADDED), as the real API server does.
- ConfigMaps (``/api/v1/namespaces/{ns}/configmaps[/{name}]``) and Leases
  (``/apis/coordination.k8s.io/v1/namespaces/{ns}/leases[/{name}]``): GET, POST (409 AlreadyExists), PUT (404, 409
  Conflict on a stale resourceVersion).
- Errors are Status objects. Requests must carry ``Authorization: Bearer <token>``.

Test hooks: add_node / update_node / delete_node, compact(), fail_next(), drop_watches(), the ``requests`` log, the
``configmaps`` and ``leases`` stores (keyed by (namespace, name)), write_kubeconfig(); ``objects``: read-only Pods,
Services, Secrets, Deployments, DaemonSets, CRDs and /version (tests/support/fakeobjects.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.support.fakeobjects import Objects

Obj = dict[str, Any]

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
JSON_BODY: web.RequestKey[Any] = web.RequestKey("json_body", object)
MICROTIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


def status_object(code: int, message: str, reason: str | None = None, details: Obj | None = None) -> Obj:
    body: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def status_response(code: int, message: str, reason: str | None = None, details: Obj | None = None) -> web.Response:
    return web.json_response(status_object(code, message, reason, details), status=code)


def truthy(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (kubernetes_asyncio sends "True")."""
    return value is not None and value.lower() not in ("", "false", "0")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


Requirement = tuple[str, str, str]  # (key, op, value) with op in "exists", "!exists", "=", "!="


def parse_selector(selector: str) -> list[Requirement]:
    """Equality-based label selectors: ``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``, ANDed."""
    reqs: list[Requirement] = []
    for raw in selector.split(","):
        part = raw.strip()
        if not part:
            continue
        if "!=" in part:
            key, value = part.split("!=", 1)
            reqs.append((key.strip(), "!=", value.strip()))
        elif "=" in part:
            key, value = part.replace("==", "=", 1).split("=", 1)
            reqs.append((key.strip(), "=", value.strip()))
        elif part.startswith("!"):
            reqs.append((part[1:].strip(), "!exists", ""))
        else:
            reqs.append((part, "exists", ""))
    return reqs


def matches(reqs: Sequence[Requirement], obj: Obj | None) -> bool:
    if obj is None:
        return False
    labels: Mapping[str, str] = obj.get("metadata", {}).get("labels") or {}
    for key, op, value in reqs:
        if op == "exists" and key not in labels:
            return False
        if op == "!exists" and key in labels:
            return False
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
    return True


@dataclass
class Req:
    method: str
    path: str
    query: dict[str, str]
    body: Any = None

    @property
    def watch(self) -> bool:
        return truthy(self.query.get("watch"))


@dataclass
class _Failure:
    method: str
    prefix: str
    status: int
    times: int
    message: str


@dataclass
class _Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    old: Obj | None
    new: Obj | None  # for DELETED: the object as deleted (with the deletion's resourceVersion)


@dataclass
class _Store:
    kind: str
    api_version: str
    plural: str
    items: dict[tuple[str, str], Obj] = field(default_factory=dict)


def _addresses(addresses: Iterable[str | tuple[str, str]], name: str) -> list[Obj]:
    out: list[Obj] = []
    for entry in addresses:
        kind, address = ("InternalIP", entry) if isinstance(entry, str) else entry
        out.append({"type": kind, "address": address})
    out.append({"type": "Hostname", "address": name})
    return out


def _conditions(ready: bool) -> list[Obj]:
    return [
        {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
        {"type": "Ready", "status": "True" if ready else "False",
         "reason": "KubeletReady" if ready else "KubeletNotReady", "lastTransitionTime": _now()},
    ]


class FakeKube:
    def __init__(self, bookmark_interval: float = 1.0, token: str = "fake-token", host: str = "127.0.0.1") -> None:
        self.host = host  # the address it listens on
        self.bookmark_interval = bookmark_interval
        self.token = token
        self.rv = 1  # the global resourceVersion counter (one etcd revision for all kinds)
        self.nodes: dict[str, Obj] = {}
        self.events: list[_Event] = []
        self.compacted_rv = 0  # events at or below this revision are gone from the history
        self.requests: list[Req] = []
        self.cm_store = _Store("ConfigMap", "v1", "configmaps")
        self.lease_store = _Store("Lease", "coordination.k8s.io/v1", "leases")
        self.configmaps = self.cm_store.items
        self.leases = self.lease_store.items
        self.objects = Objects()
        self.active_watches = 0
        self._failures: list[_Failure] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._drop_generation = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/api/v1/nodes", self._nodes)
        core = "/api/v1/namespaces/{ns}/configmaps"
        coord = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
        for base, store in ((core, self.cm_store), (coord, self.lease_store)):
            app.router.add_get(base, self._lister(store))
            app.router.add_post(base, self._creator(store))
            app.router.add_get(base + "/{name}", self._getter(store))
            app.router.add_put(base + "/{name}", self._replacer(store))
        self.objects.add_routes(app)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def close(self) -> None:
        self._closing = True
        self._notify()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig (JSON is YAML) pointing at this server with a dummy bearer token."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake-user", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake-user",
                                                       "namespace": namespace}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(doc, indent=2))
        return path

    # -- test hooks -----------------------------------------------------------------------------------------------

    def fail_next(self, method: str, path_prefix: str, status: int, times: int = 1, message: str = "") -> None:
        """The next ``times`` requests with this method ("*" for any) and path prefix get ``status``."""
        self._failures.append(_Failure(method.upper(), path_prefix, status, times, message or "injected failure"))

    def compact(self) -> int:
        """Forget the event history up to now: watches from an older resourceVersion get 410."""
        self.compacted_rv = self.rv
        self.events.clear()
        self._notify()
        return self.compacted_rv

    def drop_watches(self) -> None:
        """End every open watch now, as if the API server restarted its watch cache."""
        self._drop_generation += 1
        self._notify()

    def bump(self) -> int:
        """Advance the global resourceVersion without touching nodes (other kinds change all the time)."""
        return self._next_rv()

    def add_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        addresses: Iterable[str | tuple[str, str]] = (),
        ready: bool = True,
    ) -> Obj:
        if name in self.nodes:
            raise ValueError(f"node {name} exists")
        node: Obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "resourceVersion": str(self._next_rv()),
                "creationTimestamp": _now(),
                "labels": dict(labels or {}),
            },
            "spec": {},
            "status": {"addresses": _addresses(addresses, name), "conditions": _conditions(ready)},
        }
        self.nodes[name] = node
        self._record("ADDED", None, node)
        return node

    def update_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        addresses: Iterable[str | tuple[str, str]] | None = None,
        ready: bool | None = None,
    ) -> Obj:
        """Replace the given fields (labels replace all labels); None leaves a field as it is."""
        old = self.nodes[name]
        node = copy.deepcopy(old)
        if labels is not None:
            node["metadata"]["labels"] = dict(labels)
        if addresses is not None:
            node["status"]["addresses"] = _addresses(addresses, name)
        if ready is not None:
            node["status"]["conditions"] = _conditions(ready)
        node["metadata"]["resourceVersion"] = str(self._next_rv())
        self.nodes[name] = node
        self._record("MODIFIED", old, node)
        return node

    def delete_node(self, name: str) -> None:
        old = self.nodes.pop(name)
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self._next_rv())
        self._record("DELETED", old, gone)

    def node_requests(self, watch: bool | None = None) -> list[Req]:
        return [r for r in self.requests if r.path == "/api/v1/nodes" and (watch is None or r.watch == watch)]

    # -- internals ------------------------------------------------------------------------------------------------

    def _next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def _record(self, kind: str, old: Obj | None, new: Obj | None) -> None:
        self.events.append(_Event(self.rv, kind, copy.deepcopy(old), copy.deepcopy(new)))
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body: Any = None
        if request.can_read_body:
            text = await request.text()
            try:
                body = json.loads(text)
            except ValueError:
                body = text
        self.requests.append(Req(request.method, request.path, dict(request.query), body))
        request[JSON_BODY] = body
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return status_response(401, "Unauthorized")
        for failure in self._failures:
            if failure.method in ("*", request.method) and request.path.startswith(failure.prefix):
                failure.times -= 1
                if failure.times <= 0:
                    self._failures.remove(failure)
                return status_response(failure.status, failure.message)
        response: web.StreamResponse = await handler(request)
        return response

    # -- nodes ----------------------------------------------------------------------------------------------------

    async def _nodes(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        try:
            reqs = parse_selector(query.get("labelSelector", ""))
        except ValueError as exc:
            return status_response(400, f"unable to parse requirement: {exc}")
        if truthy(query.get("watch")):
            return await self._watch(request, reqs)
        items = [copy.deepcopy(n) for _, n in sorted(self.nodes.items()) if matches(reqs, n)]
        return web.json_response({
            "apiVersion": "v1",
            "kind": "NodeList",
            "metadata": {"resourceVersion": str(self.rv)},
            "items": items,
        })

    @staticmethod
    def _filtered(event: _Event, reqs: Sequence[Requirement]) -> Obj | None:
        """The event a watch with this selector sees, if any."""
        old_in, new_in = matches(reqs, event.old), matches(reqs, event.new)
        if event.type == "DELETED":
            return {"type": "DELETED", "object": event.new} if old_in else None
        if new_in:
            return {"type": "MODIFIED" if old_in else "ADDED", "object": event.new}
        if old_in:  # left the selector: a DELETED of the previous state at the new resourceVersion
            assert event.old is not None and event.new is not None
            obj = copy.deepcopy(event.old)
            obj["metadata"]["resourceVersion"] = event.new["metadata"]["resourceVersion"]
            return {"type": "DELETED", "object": obj}
        return None

    async def _watch(self, request: web.Request, reqs: Sequence[Requirement]) -> web.StreamResponse:
        query = request.query
        loop = asyncio.get_running_loop()
        bookmarks = truthy(query.get("allowWatchBookmarks"))
        timeout = float(query.get("timeoutSeconds", "1800"))
        deadline = loop.time() + timeout
        rv_text = query.get("resourceVersion", "")
        try:
            start_rv = int(rv_text) if rv_text else 0
        except ValueError:
            return status_response(400, f"invalid resourceVersion {rv_text!r}")

        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(event: Obj) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        generation = self._drop_generation
        self.active_watches += 1
        try:
            if start_rv == 0:  # "any": the current state as ADDED events, then changes
                pos = self.rv
                for _, node in sorted(self.nodes.items()):
                    if matches(reqs, node):
                        await send({"type": "ADDED", "object": copy.deepcopy(node)})
            else:
                pos = start_rv
            next_bookmark = loop.time() + self.bookmark_interval
            while not self._closing and generation == self._drop_generation:
                wake = self._wake
                if pos < self.compacted_rv:
                    await send({"type": "ERROR", "object": status_object(
                        410, f"too old resource version: {pos} ({self.compacted_rv})", "Expired")})
                    break
                head = self.rv  # every event up to here is in the log (or compacted, checked above)
                for event in [e for e in self.events if e.rv > pos]:
                    seen = self._filtered(event, reqs)
                    if seen is not None:
                        await send(seen)
                pos = max(pos, head)
                now = loop.time()
                if now >= deadline:
                    break
                if bookmarks and now >= next_bookmark:
                    await send({"type": "BOOKMARK", "object": {
                        "kind": "Node", "apiVersion": "v1", "metadata": {"resourceVersion": str(pos)}}})
                    next_bookmark = now + self.bookmark_interval
                wait = deadline - now
                if bookmarks:
                    wait = min(wait, next_bookmark - now)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), max(wait, 0.0))
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away
        finally:
            self.active_watches -= 1
        return response

    # -- namespaced objects (ConfigMaps, Leases) ------------------------------------------------------------------

    def _details(self, store: _Store, name: str) -> Obj:
        group = store.api_version.split("/")[0] if "/" in store.api_version else ""
        return {"name": name, "group": group, "kind": store.plural}

    def _validate(self, store: _Store, body: Any, ns: str) -> str | None:
        if not isinstance(body, dict):
            return "the body is not a JSON object"
        if body.get("kind", store.kind) != store.kind or body.get("apiVersion", store.api_version) != store.api_version:
            return f"expected {store.api_version} {store.kind}, got {body.get('apiVersion')} {body.get('kind')}"
        meta = body.get("metadata")
        if not isinstance(meta, dict) or not meta.get("name"):
            return "metadata.name: Required value"
        if meta.get("namespace", ns) != ns:
            return "the namespace of the provided object does not match the namespace sent on the request"
        if store is self.cm_store:
            data = body.get("data") or {}
            if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
                return "data: values must be strings"
        if store is self.lease_store:
            spec = body.get("spec") or {}
            for key in ("acquireTime", "renewTime"):
                value = spec.get(key)
                if value is not None and not MICROTIME.match(str(value)):
                    return f"spec.{key}: {value!r} is not a MicroTime (2006-01-02T15:04:05.000000Z)"
            duration = spec.get("leaseDurationSeconds")
            if duration is not None and (not isinstance(duration, int) or isinstance(duration, bool)):
                return "spec.leaseDurationSeconds: must be an integer"
        return None

    def _lister(self, store: _Store) -> Any:
        async def handler(request: web.Request) -> web.Response:
            ns = request.match_info["ns"]
            items = [copy.deepcopy(o) for (n, _), o in sorted(store.items.items()) if n == ns]
            return web.json_response({"apiVersion": store.api_version, "kind": store.kind + "List",
                                      "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        return handler

    def _getter(self, store: _Store) -> Any:
        async def handler(request: web.Request) -> web.Response:
            ns, name = request.match_info["ns"], request.match_info["name"]
            obj = store.items.get((ns, name))
            if obj is None:
                return status_response(404, f'{store.plural} "{name}" not found', details=self._details(store, name))
            return web.json_response(obj)
        return handler

    def _creator(self, store: _Store) -> Any:
        async def handler(request: web.Request) -> web.Response:
            ns = request.match_info["ns"]
            body = request[JSON_BODY]
            problem = self._validate(store, body, ns)
            if problem:
                return status_response(422, f"{store.kind} is invalid: {problem}", "Invalid")
            name = body["metadata"]["name"]
            if (ns, name) in store.items:
                return status_response(409, f'{store.plural} "{name}" already exists', "AlreadyExists",
                                       self._details(store, name))
            obj = copy.deepcopy(body)
            obj["apiVersion"], obj["kind"] = store.api_version, store.kind
            meta = obj["metadata"]
            meta.update(namespace=ns, uid=str(uuid.uuid4()), resourceVersion=str(self._next_rv()),
                        creationTimestamp=_now())
            store.items[(ns, name)] = obj
            return web.json_response(obj, status=201)
        return handler

    def _replacer(self, store: _Store) -> Any:
        async def handler(request: web.Request) -> web.Response:
            ns, name = request.match_info["ns"], request.match_info["name"]
            body = request[JSON_BODY]
            problem = self._validate(store, body, ns)
            if problem:
                return status_response(422, f"{store.kind} is invalid: {problem}", "Invalid")
            if body["metadata"]["name"] != name:
                return status_response(400, "the name of the object does not match the name on the URL")
            current = store.items.get((ns, name))
            if current is None:
                return status_response(404, f'{store.plural} "{name}" not found', details=self._details(store, name))
            sent_rv = body["metadata"].get("resourceVersion")
            if sent_rv is not None and sent_rv != current["metadata"]["resourceVersion"]:
                return status_response(
                    409,
                    f'Operation cannot be fulfilled on {store.plural} "{name}": the object has been modified; '
                    "please apply your changes to the latest version and try again",
                    "Conflict", self._details(store, name))
            obj = copy.deepcopy(body)
            obj["apiVersion"], obj["kind"] = store.api_version, store.kind
            meta = obj["metadata"]
            meta.update(namespace=ns, uid=current["metadata"]["uid"],
                        creationTimestamp=current["metadata"]["creationTimestamp"],
                        resourceVersion=str(self._next_rv()))
            store.items[(ns, name)] = obj
            return web.json_response(obj)
        return handler
