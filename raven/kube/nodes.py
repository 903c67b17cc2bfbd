"""The node inventory from Kubernetes: Node objects of edge pools (:class:`KubeNode`), kept in step by LIST then
WATCH (:class:`NodeWatcher`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import types
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from raven.errors import KubeError
from raven.kube.client import MAX_BACKOFF, KubeApiError, call_json, check_status, describe

log = logging.getLogger("raven.kube")

# ---------------------------------------------------------------------------------------------------------------
# nodes


@dataclass(frozen=True)
class KubeNode:
    name: str
    pool: str | None
    addresses: tuple[str, ...]  # InternalIP first, then ExternalIP, each in the order of status.addresses
    ready: bool
    labels: Mapping[str, str] = field(default_factory=lambda: types.MappingProxyType({}), hash=False, repr=False)
    internal: int = field(default=0, compare=False)  # how many of the first addresses are InternalIPs

    @property
    def internal_ip(self) -> str | None:
        """The node's first InternalIP (what a direct pool's scrape goes to), None when it has none."""
        return self.addresses[0] if self.internal else None

    @classmethod
    def from_object(cls, obj: Mapping[str, Any], pool_label: str) -> KubeNode:
        """Build from a Node object as the API sends it (JSON, camelCase)."""
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        addresses: list[str] = []
        internal = 0
        for kind in ("InternalIP", "ExternalIP"):
            for entry in status.get("addresses") or ():
                address = entry.get("address")
                if entry.get("type") == kind and address and address not in addresses:
                    addresses.append(str(address))
                    internal += kind == "InternalIP"
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
        )
        return cls(
            name=str(meta.get("name", "")),
            pool=labels.get(pool_label),
            addresses=tuple(addresses),
            ready=ready,
            labels=types.MappingProxyType(labels),
            internal=internal,
        )


class _Gone(KubeError):
    """The resourceVersion we watch from is no longer in the server's history: LIST again."""


class NodeWatcher:
    """Keeps ``nodes`` in step with the Node objects that carry ``pool_label`` (and match ``selector``).

    One LIST, then WATCHes from its resourceVersion (with bookmarks, ended by the server every ``watch_timeout``
    seconds and resumed from the last resourceVersion seen). A 410 (history compacted) means LIST again; other errors
    are retried with exponential backoff (``relist_backoff`` doubling up to 30 s), resuming the watch when possible.
    """

    def __init__(
        self,
        api: ApiClient,
        pool_label: str,
        selector: str = "",
        on_change: Callable[[dict[str, KubeNode]], None] | None = None,
        relist_backoff: float = 1.0,
        watch_timeout: int = 300,
        request_timeout: float = 30.0,
    ) -> None:
        self._v1 = client.CoreV1Api(api)
        self.pool_label = pool_label
        self.label_selector = ",".join(part for part in (pool_label, selector.strip()) if part)
        self.on_change = on_change
        self.relist_backoff = relist_backoff
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.nodes: dict[str, KubeNode] = {}
        self.synced = asyncio.Event()
        self.resource_version: str | None = None
        self.lists = 0  # successful LISTs
        self.watches = 0  # WATCH requests started

    async def run(self) -> None:
        """Run until cancelled."""
        loop = asyncio.get_running_loop()
        backoff = self.relist_backoff
        need_list = True
        gone_in_a_row = 0
        while True:
            try:
                if need_list:
                    await self._list()
                    need_list = False
                started = loop.time()
                events = await self._watch()
                gone_in_a_row = 0
                if events == 0 and loop.time() - started < 1.0:
                    # a very short, empty watch (as client-go calls it): do not spin if the server ends them at once
                    log.debug("very short watch; retrying in %.1fs", backoff)
                    await asyncio.sleep(self._jitter(backoff))
                    backoff = min(backoff * 2, MAX_BACKOFF)
                else:
                    backoff = self.relist_backoff
            except _Gone as exc:
                log.info("node watch: %s; listing again", exc)
                need_list = True
                gone_in_a_row += 1
                if gone_in_a_row > 1:  # expired again right after a LIST: back off rather than spin
                    await asyncio.sleep(self._jitter(backoff))
                    backoff = min(backoff * 2, MAX_BACKOFF)
            except Exception as exc:
                what = "list" if need_list else "watch"
                hint = ""
                if isinstance(exc, KubeApiError) and exc.status == 403:
                    hint = " (RBAC must allow verbs 'list' and 'watch' on resource 'nodes', cluster-wide)"
                log.warning("node %s failed (%s)%s; retrying in %.1fs", what, describe(exc), hint, backoff)
                await asyncio.sleep(self._jitter(backoff))
                backoff = min(backoff * 2, MAX_BACKOFF)

    @staticmethod
    def _jitter(delay: float) -> float:
        return delay * random.uniform(0.8, 1.2)

    async def _list(self) -> None:
        body = await call_json(self._v1.list_node, label_selector=self.label_selector, timeout=self.request_timeout)
        nodes: dict[str, KubeNode] = {}
        for item in body.get("items") or ():
            node = KubeNode.from_object(item, self.pool_label)
            nodes[node.name] = node
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if not rv:
            raise KubeError("node list without metadata.resourceVersion")
        first = not self.synced.is_set()
        changed = nodes != self.nodes
        self.nodes = nodes
        self.resource_version = str(rv)
        self.lists += 1
        self.synced.set()
        log.debug("listed %d nodes at resourceVersion %s", len(nodes), rv)
        if first or changed:
            self._notify()

    async def _watch(self) -> int:
        """One WATCH request; returns the number of events handled when the server ends it."""
        self.watches += 1
        list_node: Callable[..., Awaitable[Any]] = self._v1.list_node  # typed for the model, not a raw response
        async with asyncio.timeout(self.request_timeout):  # opening it (and any credential refresh), not the stream
            resp: aiohttp.ClientResponse = await list_node(
                watch=True,
                label_selector=self.label_selector,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout,
                _preload_content=False,
                # the server ends the watch; this only catches a connection that went silent
                _request_timeout=aiohttp.ClientTimeout(sock_connect=self.request_timeout,
                                                       sock_read=self.watch_timeout + 30),
            )
        count = 0
        try:
            if resp.status == 410:
                raise _Gone(f"resourceVersion {self.resource_version} is too old (HTTP 410)")
            await check_status(resp)
            while True:
                line = await resp.content.readline()
                if not line:
                    return count
                line = line.strip()
                if not line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError as exc:
                    raise KubeError(f"watch sent a line that is not JSON: {line[:200]!r}") from exc
                self._handle(event)
                count += 1
        finally:
            resp.close()  # never reuse a connection that may still carry a watch stream

    def _handle(self, event: Any) -> None:
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise KubeError(f"malformed watch event: {str(event)[:200]}")
        kind = event.get("type")
        obj: dict[str, Any] = event["object"]
        if kind == "ERROR":
            code = obj.get("code")
            message = f"{obj.get('reason', '')}: {obj.get('message', '')}"
            if code == 410:
                raise _Gone(f"resourceVersion {self.resource_version} expired ({message})")
            raise KubeApiError(int(code) if isinstance(code, int) else 0, str(obj.get("reason", "")),
                               str(obj.get("message", "")))
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            if rv:
                self.resource_version = str(rv)
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("ignoring watch event of type %r", kind)
            return
        node = KubeNode.from_object(obj, self.pool_label)
        if rv:
            self.resource_version = str(rv)
        if kind == "DELETED":
            changed = self.nodes.pop(node.name, None) is not None
        else:
            changed = self.nodes.get(node.name) != node
            self.nodes[node.name] = node
        if changed:
            self._notify()

    def _notify(self) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(dict(self.nodes))
        except Exception:
            log.exception("node change callback failed")
