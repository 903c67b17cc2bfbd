"""A thin Kubernetes layer on kubernetes_asyncio: the node inventory (LIST + WATCH), publishing a ConfigMap, and
leader election with a coordination.k8s.io/v1 Lease.

Every request goes through kubernetes_asyncio (configuration, authentication, URLs, query parameters) but is made
with ``_preload_content=False`` and its JSON read here: the library's models are bypassed on purpose. That keeps the
watch in our hands (resourceVersion, bookmarks, 410), avoids a model round trip that would rewrite fields we do not
own, and lets us write Lease MicroTime values exactly (``2006-01-02T15:04:05.000000Z``), which the library's
``datetime.isoformat()`` serialization does not (``+00:00``, and no fraction at zero microseconds).

Why this module is long and not split: it is the whole Kubernetes layer (Node watch, ConfigMap publishing,
Lease election) on one thin client wrapper, and all three share its deadlines and error mapping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import types
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import ApiClient

from raven.dns.hosts import CONFIGMAP_MAX_BYTES
from raven.errors import KubeError

log = logging.getLogger("raven.kube")

MANAGED_BY = {"app.kubernetes.io/managed-by": "raven"}
MAX_BACKOFF = 30.0


class KubeApiError(KubeError):
    """The API server answered with an error status (the Status object's code, reason and message)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.message = message


# ---------------------------------------------------------------------------------------------------------------
# client


async def api_client(kubeconfig: Path | None, timeout: float = 30.0) -> ApiClient:
    """An ApiClient (the caller closes it): in-cluster service account when ``kubeconfig`` is None, else that file.

    The configuration is private to this client (the library's process-wide default is left alone), and a kubeconfig
    is never written back (``persist_config=False``).
    """
    cfg = client.Configuration()
    load_incluster: Callable[..., None] = config.load_incluster_config  # untyped in the library
    try:
        if kubeconfig is None:
            load_incluster(client_configuration=cfg)
        else:
            # the library would only say "Expected key current-context" for a missing file
            if not await asyncio.to_thread(kubeconfig.is_file):
                raise KubeError(f"kubeconfig {kubeconfig}: no such file")
            # An exec credential plugin runs here, with no deadline of the library's own.
            async with asyncio.timeout(timeout):
                await config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg,
                                              persist_config=False)
    except KubeError:
        raise
    except TimeoutError:
        raise KubeError(
            f"loading kubeconfig {kubeconfig} took over {timeout:g}s (a credential plugin that hangs?)"
        ) from None
    except Exception as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig is not None else "in-cluster configuration"
        hint = "" if kubeconfig is not None else " (not running in a pod? pass a kubeconfig)"
        raise KubeError(f"cannot load {where}{hint}: {type(exc).__name__}: {exc}") from exc
    api: ApiClient = ApiClient(configuration=cfg)
    return api


def _status_error(status: int, reason: str, text: str) -> KubeApiError:
    """Turn an error response into KubeApiError, using the Status object's reason and message when there is one."""
    message = text.strip()[:500]
    with contextlib.suppress(ValueError):
        body = json.loads(text)
        if isinstance(body, dict) and body.get("kind") == "Status":
            reason = str(body.get("reason") or reason)
            message = str(body.get("message") or "")
    return KubeApiError(status, reason, message)


async def _check(resp: aiohttp.ClientResponse) -> None:
    if not 200 <= resp.status < 300:
        raise _status_error(resp.status, resp.reason or "", await resp.text())


async def _call_json(
    func: Callable[..., Awaitable[Any]], *args: Any, timeout: float, **kwargs: Any
) -> dict[str, Any]:
    """Call an API method without the library's models and return the JSON body; KubeApiError on error statuses.

    ``timeout`` bounds the whole call, a credential refresh (exec plugin) included, not just the HTTP request.
    """
    async with asyncio.timeout(timeout):
        resp: aiohttp.ClientResponse = await func(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
        try:
            await _check(resp)
            text = await resp.text()
        finally:
            resp.release()
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise KubeError(f"API server sent a body that is not JSON: {text[:200]!r}") from exc
    if not isinstance(body, dict):
        raise KubeError(f"API server sent JSON that is not an object: {text[:200]!r}")
    return body


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


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
                log.warning("node %s failed (%s)%s; retrying in %.1fs", what, _describe(exc), hint, backoff)
                await asyncio.sleep(self._jitter(backoff))
                backoff = min(backoff * 2, MAX_BACKOFF)

    @staticmethod
    def _jitter(delay: float) -> float:
        return delay * random.uniform(0.8, 1.2)

    async def _list(self) -> None:
        body = await _call_json(self._v1.list_node, label_selector=self.label_selector, timeout=self.request_timeout)
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
            await _check(resp)
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


# ---------------------------------------------------------------------------------------------------------------
# ConfigMap


class ConfigMapPublisher:
    """Writes one key of one ConfigMap, only when its content changes, leaving the other keys alone."""

    attempts = 5

    def __init__(
        self,
        api: ApiClient,
        namespace: str,
        name: str,
        key: str,
        field_manager: str = "raven",
        request_timeout: float = 30.0,
        conflict_backoff: float = 0.1,
    ) -> None:
        self._v1 = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = name
        self.key = key
        self.field_manager = field_manager
        self.request_timeout = request_timeout
        self.conflict_backoff = conflict_backoff

    def _error(self, verb: str, exc: Exception) -> KubeError:
        where = f"ConfigMap {self.namespace}/{self.name}"
        if isinstance(exc, KubeApiError) and exc.status == 403:
            return KubeError(f"{verb} {where} forbidden: RBAC must allow verb '{verb}' on resource 'configmaps' "
                             f"(apiGroup \"\") in namespace {self.namespace!r} ({exc.message})")
        return KubeError(f"{verb} {where} failed: {_describe(exc)}")

    async def publish(self, content: str, allowed: Callable[[], bool] | None = None) -> bool:
        """Make ``data[key] == content``; True when something was written, False when it already was so.

        ``allowed`` is asked right before every write (e.g. "do we still hold the Lease?"): a publisher
        that lost its right while a read was slow writes nothing.
        """
        size = len(content.encode())
        if size > CONFIGMAP_MAX_BYTES:
            # Checked before writing: the API server would refuse it, and the last good file stays published.
            raise KubeError(f"ConfigMap {self.namespace}/{self.name}: {size} bytes would exceed the "
                            f"{CONFIGMAP_MAX_BYTES}-byte limit of a ConfigMap; not written (the last one stays)")
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.conflict_backoff * 2 ** (attempt - 1) * random.uniform(0.8, 1.2))
            try:
                current: dict[str, Any] | None = await _call_json(
                    self._v1.read_namespaced_config_map, self.name, self.namespace, timeout=self.request_timeout)
            except KubeApiError as exc:
                if exc.status != 404:
                    raise self._error("get", exc) from exc
                current = None
            except (aiohttp.ClientError, TimeoutError, KubeError) as exc:
                raise self._error("get", exc) from exc

            if allowed is not None and not allowed():
                return False
            if current is None:
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": self.name, "namespace": self.namespace, "labels": dict(MANAGED_BY)},
                    "data": {self.key: content},
                }
                try:
                    await _call_json(self._v1.create_namespaced_config_map, self.namespace, body,
                                     field_manager=self.field_manager, timeout=self.request_timeout)
                except KubeApiError as exc:
                    if exc.status == 409:  # created by someone else meanwhile: read it and compare
                        last = f"create: {exc}"
                        continue
                    raise self._error("create", exc) from exc
                except (aiohttp.ClientError, TimeoutError, KubeError) as exc:
                    raise self._error("create", exc) from exc
                log.info("created ConfigMap %s/%s", self.namespace, self.name)
                return True

            data = dict(current.get("data") or {})
            if data.get(self.key) == content:
                return False
            data[self.key] = content
            current["data"] = data  # the object as read (resourceVersion included): an optimistic update
            try:
                await _call_json(self._v1.replace_namespaced_config_map, self.name, self.namespace, current,
                                 field_manager=self.field_manager, timeout=self.request_timeout)
            except KubeApiError as exc:
                if exc.status in (409, 404):  # changed or deleted since we read it
                    last = f"update: {exc}"
                    continue
                raise self._error("update", exc) from exc
            except (aiohttp.ClientError, TimeoutError, KubeError) as exc:
                raise self._error("update", exc) from exc
            log.info("updated key %s of ConfigMap %s/%s", self.key, self.namespace, self.name)
            return True
        raise KubeError(f"ConfigMap {self.namespace}/{self.name}: still conflicting after {self.attempts} attempts "
                        f"({last})")


# ---------------------------------------------------------------------------------------------------------------
# Lease


def format_microtime(when: datetime) -> str:
    """A metav1.MicroTime: RFC 3339 in UTC with exactly six fractional digits and 'Z'."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


class LeaseElector:
    """Leader election on a coordination.k8s.io/v1 Lease, as client-go does it, without its clock-skew guard.

    Every ``duration / 3`` seconds: create the Lease if absent, renew it when we hold it, take it over when its holder
    let it expire (renewTime + leaseDurationSeconds in the past). Updates carry the resourceVersion read, so a 409
    means someone else won. Any error, and a renewal that does not succeed within ``2/3 * duration`` of the previous
    one, ends leadership (fail safe); the loop keeps trying.
    """

    def __init__(
        self,
        api: ApiClient,
        namespace: str,
        name: str,
        identity: str,
        duration: float = 15.0,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        if not identity:
            raise ValueError("a lease identity must not be empty")
        self._api = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration = duration
        self.on_change = on_change
        self.is_leader = False
        self.leader_changed = asyncio.Event()  # set on every change of is_leader; waiters clear it
        self.holder: str | None = None  # the holder seen last
        self._valid_until = 0.0  # loop time until which our last renewal keeps us leader
        self._stopped = False

    @property
    def lease_seconds(self) -> int:
        return max(1, math.ceil(self.duration))

    def _set_leader(self, leader: bool) -> None:
        if leader == self.is_leader:
            return
        self.is_leader = leader
        log.info("lease %s/%s: %s", self.namespace, self.name, "acquired" if leader else "not leader")
        self.leader_changed.set()
        if self.on_change is not None:
            try:
                self.on_change(leader)
            except Exception:
                log.exception("leader change callback failed")

    async def run(self) -> None:
        """Run until cancelled (or until release()); leadership ends with it."""
        loop = asyncio.get_running_loop()
        try:
            while not self._stopped:
                if self.is_leader:
                    budget = self._valid_until - loop.time()
                else:
                    budget = self.duration
                try:
                    async with asyncio.timeout(max(budget, 0.0)):
                        await self._attempt()
                except Exception as exc:
                    if isinstance(exc, TimeoutError):
                        exc = KubeError(f"no answer within {budget:.1f}s")
                    log.warning("lease %s/%s: %s", self.namespace, self.name, _describe(exc))
                    self._set_leader(False)
                await asyncio.sleep(self.duration / 3)
        finally:
            self._set_leader(False)

    def _spec(self, now: datetime, transitions: int, acquired: str | None = None) -> dict[str, Any]:
        stamp = format_microtime(now)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "acquireTime": acquired or stamp,
            "renewTime": stamp,
            "leaseTransitions": transitions,
        }

    async def _attempt(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = self.duration
        try:
            lease: dict[str, Any] | None = await _call_json(
                self._api.read_namespaced_lease, self.name, self.namespace, timeout=timeout)
        except KubeApiError as exc:
            if exc.status != 404:
                raise
            lease = None
        if self._stopped:
            return
        now = datetime.now(UTC)

        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace, "labels": dict(MANAGED_BY)},
                "spec": self._spec(now, 0),
            }
            try:
                await _call_json(self._api.create_namespaced_lease, self.namespace, body, timeout=timeout)
            except KubeApiError as exc:
                if exc.status == 409:  # another candidate created it first
                    self._set_leader(False)
                    return
                raise
            self._won(started)
            return

        spec: dict[str, Any] = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        self.holder = holder or None
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder == self.identity:
            new_spec = self._spec(now, transitions, acquired=spec.get("acquireTime"))
        elif holder and not self._expired(spec, now):
            self._set_leader(False)
            return
        else:
            new_spec = self._spec(now, transitions + 1)  # a new holder: one more transition
            if holder:
                log.info("lease %s/%s: taking over from %s, whose lease expired", self.namespace, self.name, holder)
        lease["spec"] = new_spec
        try:
            await _call_json(self._api.replace_namespaced_lease, self.name, self.namespace, lease, timeout=timeout)
        except KubeApiError as exc:
            if exc.status in (409, 404):  # lost the race (or it was deleted): look again next round
                self._set_leader(False)
                return
            raise
        self._won(started)

    def _won(self, started: float) -> None:
        if self._stopped:  # release() ran meanwhile; it will not find us holding, but do not act as leader
            return
        self.holder = self.identity
        self._valid_until = started + self.duration * 2 / 3
        self._set_leader(True)

    @staticmethod
    def _expired(spec: Mapping[str, Any], now: datetime) -> bool:
        renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
        seconds = spec.get("leaseDurationSeconds")
        if renewed is None or not isinstance(seconds, int):
            return True
        return renewed + timedelta(seconds=seconds) < now

    async def release(self) -> bool:
        """Give the lease up (for a clean shutdown) and stop run(); True when a lease we held was cleared."""
        self._stopped = True
        was_leader = self.is_leader
        self._set_leader(False)  # stop acting as leader before anyone else can start
        try:
            lease = await _call_json(self._api.read_namespaced_lease, self.name, self.namespace,
                                     timeout=self.duration)
            spec: dict[str, Any] = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return False
            now = format_microtime(datetime.now(UTC))
            spec.pop("holderIdentity", None)
            spec.update(leaseDurationSeconds=1, acquireTime=now, renewTime=now)
            lease["spec"] = spec
            await _call_json(self._api.replace_namespaced_lease, self.name, self.namespace, lease,
                             timeout=self.duration)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            level = logging.WARNING if was_leader else logging.DEBUG
            log.log(level, "lease %s/%s: release failed: %s", self.namespace, self.name, _describe(exc))
            return False
        self.holder = None
        log.info("lease %s/%s: released", self.namespace, self.name)
        return True
