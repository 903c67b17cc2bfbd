"""Publishing the hosts file as a ConfigMap (:class:`ConfigMapPublisher`): create or update only when it
changes, and only while allowed (the Lease holder).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from raven.dns.hosts import CONFIGMAP_MAX_BYTES
from raven.errors import KubeError
from raven.kube.client import MANAGED_BY, KubeApiError, call_json, describe
from raven.kube.lease import LeaseElector

log = logging.getLogger("raven.kube")

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
        return KubeError(f"{verb} {where} failed: {describe(exc)}")

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
                current: dict[str, Any] | None = await call_json(
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
                    await call_json(self._v1.create_namespaced_config_map, self.namespace, body,
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
                await call_json(self._v1.replace_namespaced_config_map, self.name, self.namespace, current,
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


def leader_sink(elector: LeaseElector, publisher: ConfigMapPublisher) -> Callable[[str], Awaitable[bool]]:
    """A hosts-file sink that writes the ConfigMap only while this replica holds the Lease (else: not written)."""

    async def publish(content: str) -> bool:
        if not elector.is_leader:
            return False  # another replica holds the Lease and publishes
        return await publisher.publish(content, allowed=lambda: elector.is_leader)

    return publish
