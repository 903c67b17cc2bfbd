"""Leader election with a coordination.k8s.io/v1 Lease (:class:`LeaseElector`): one replica publishes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from raven.errors import KubeError
from raven.kube.client import MANAGED_BY, KubeApiError, call_json, describe

log = logging.getLogger("raven.kube")

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
                    log.warning("lease %s/%s: %s", self.namespace, self.name, describe(exc))
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
            lease: dict[str, Any] | None = await call_json(
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
                await call_json(self._api.create_namespaced_lease, self.namespace, body, timeout=timeout)
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
            await call_json(self._api.replace_namespaced_lease, self.name, self.namespace, lease, timeout=timeout)
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
            lease = await call_json(self._api.read_namespaced_lease, self.name, self.namespace,
                                     timeout=self.duration)
            spec: dict[str, Any] = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return False
            now = format_microtime(datetime.now(UTC))
            spec.pop("holderIdentity", None)
            spec.update(leaseDurationSeconds=1, acquireTime=now, renewTime=now)
            lease["spec"] = spec
            await call_json(self._api.replace_namespaced_lease, self.name, self.namespace, lease,
                             timeout=self.duration)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            level = logging.WARNING if was_leader else logging.DEBUG
            log.log(level, "lease %s/%s: release failed: %s", self.namespace, self.name, describe(exc))
            return False
        self.holder = None
        log.info("lease %s/%s: released", self.namespace, self.name)
        return True
