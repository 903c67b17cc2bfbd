"""Read-only kinds for the fake API server (tests/support/fakekube.py), seeded by the tests: Pods, Services,
Secrets (core v1), Deployments and DaemonSets (apps/v1), CustomResourceDefinitions, and ``/version``.

- ``GET /api/v1/namespaces/{ns}/{pods,services,secrets}[/{name}]`` and
  ``GET /apis/apps/v1/namespaces/{ns}/{deployments,daemonsets}[/{name}]``: LIST (``labelSelector``) and GET (404 as
  a Status when missing);
- ``GET /api/v1/services``: every namespace's Services;
- ``GET /apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}``;
- ``GET /version``.

Test hooks: :meth:`Objects.put` (adds or replaces by kind, namespace and name), :meth:`Objects.remove`, ``version``.
"""

from __future__ import annotations

import copy
from typing import Any

from aiohttp import web

Obj = dict[str, Any]

PLURALS = {"Pod": "pods", "Service": "services", "Secret": "secrets", "Deployment": "deployments",
           "DaemonSet": "daemonsets", "CustomResourceDefinition": "customresourcedefinitions"}
API = {"pods": "v1", "services": "v1", "secrets": "v1", "deployments": "apps/v1", "daemonsets": "apps/v1",
       "customresourcedefinitions": "apiextensions.k8s.io/v1"}


class Objects:
    def __init__(self) -> None:
        self.items: dict[tuple[str, str, str], Obj] = {}  # (plural, namespace or "", name)
        self.version: Obj = {"major": "1", "minor": "31", "gitVersion": "v1.31.4"}

    def put(self, obj: Obj) -> None:
        plural = PLURALS[obj["kind"]]
        meta = obj["metadata"]
        self.items[(plural, meta.get("namespace", ""), meta["name"])] = copy.deepcopy(obj)

    def remove(self, kind: str, namespace: str, name: str) -> None:
        self.items.pop((PLURALS[kind], namespace, name), None)

    def add_routes(self, app: web.Application) -> None:
        for plural in ("pods", "services", "secrets"):
            app.router.add_get(f"/api/v1/namespaces/{{ns}}/{plural}", self._lister(plural))
            app.router.add_get(f"/api/v1/namespaces/{{ns}}/{plural}/{{name}}", self._getter(plural))
        for plural in ("deployments", "daemonsets"):
            app.router.add_get(f"/apis/apps/v1/namespaces/{{ns}}/{plural}", self._lister(plural))
            app.router.add_get(f"/apis/apps/v1/namespaces/{{ns}}/{plural}/{{name}}", self._getter(plural))
        app.router.add_get("/api/v1/services", self._lister("services", every_namespace=True))
        app.router.add_get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}",
                           self._getter("customresourcedefinitions"))
        app.router.add_get("/version", self._version)
        app.router.add_get("/version/", self._version)  # kubernetes_asyncio asks with the slash

    async def _version(self, _: web.Request) -> web.Response:
        return web.json_response(self.version)

    def _lister(self, plural: str, every_namespace: bool = False) -> Any:
        from tests.support.fakekube import matches, parse_selector, status_response

        async def handler(request: web.Request) -> web.Response:
            try:
                reqs = parse_selector(request.query.get("labelSelector", ""))
            except ValueError as exc:
                return status_response(400, f"unable to parse requirement: {exc}")
            ns = request.match_info.get("ns")
            items = [copy.deepcopy(o) for (p, n, _), o in sorted(self.items.items())
                     if p == plural and (every_namespace or n == ns) and matches(reqs, o)]
            kind = next(k for k, v in PLURALS.items() if v == plural)
            return web.json_response({"apiVersion": API[plural], "kind": kind + "List", "metadata": {},
                                      "items": items})
        return handler

    def _getter(self, plural: str) -> Any:
        from tests.support.fakekube import status_response

        async def handler(request: web.Request) -> web.Response:
            ns, name = request.match_info.get("ns", ""), request.match_info["name"]
            obj = self.items.get((plural, ns, name))
            if obj is None:
                return status_response(404, f'{plural} "{name}" not found', details={"name": name, "kind": plural})
            return web.json_response(obj)
        return handler
