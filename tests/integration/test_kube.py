"""raven.kube against a fake API server: node LIST + WATCH, ConfigMap publishing, Lease election."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import pytest

from raven.errors import KubeError
from raven.kube import ConfigMapPublisher, KubeNode, LeaseElector, NodeWatcher, api_client
from tests.support.fakekube import FakeKube
from tests.support.polling import eventually

poll = functools.partial(eventually, timeout=3, interval=0.01)

POOL = "apps.openyurt.io/nodepool"
NS = "kube-system"
CM = "edge-tunnel-nodes"
CM_PATH = f"/api/v1/namespaces/{NS}/configmaps"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"


@pytest.fixture
async def fake() -> AsyncIterator[FakeKube]:
    server = FakeKube(bookmark_interval=0.2)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def api(fake: FakeKube, tmp_path: Path) -> AsyncIterator[Any]:
    client = await api_client(fake.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, None]) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task





# -- client ------------------------------------------------------------------------------------------------------


async def test_api_client_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(KubeError, match=r"nope\.yaml: no such file"):
        await api_client(missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: v1\nclusters: [\n")
    with pytest.raises(KubeError, match=r"cannot load kubeconfig .*broken\.yaml"):
        await api_client(broken)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeError, match="in-cluster"):
        await api_client(None)


def test_kube_node_from_object() -> None:
    obj = {
        "metadata": {"name": "edge-1", "labels": {POOL: "pool-a"}},
        "status": {
            "addresses": [{"type": "Hostname", "address": "edge-1"}, {"type": "ExternalIP", "address": "203.0.113.5"},
                          {"type": "InternalIP", "address": "10.0.0.1"}, {"type": "InternalIP", "address": "fd00::1"}],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    node = KubeNode.from_object(obj, POOL)
    assert node == KubeNode("edge-1", "pool-a", ("10.0.0.1", "fd00::1", "203.0.113.5"), True, {POOL: "pool-a"})
    assert hash(node) == hash(KubeNode.from_object(obj, POOL))
    bare = KubeNode.from_object({"metadata": {"name": "x"}}, POOL)
    assert (bare.pool, bare.addresses, bare.ready) == (None, (), False)


# -- nodes -------------------------------------------------------------------------------------------------------


async def test_watcher_initial_list(fake: FakeKube, api: Any) -> None:
    fake.add_node("edge-1", {POOL: "pool-a"}, [("ExternalIP", "203.0.113.5"), "10.0.0.1", "fd00::1"])
    fake.add_node("edge-2", {POOL: "pool-b"}, ["10.0.1.1"], ready=False)
    fake.add_node("cloud-1", {"node-role.kubernetes.io/control-plane": ""}, ["10.1.0.1"])
    calls: list[dict[str, KubeNode]] = []
    watcher = NodeWatcher(api, POOL, on_change=calls.append)
    async with running(watcher.run()):
        await asyncio.wait_for(watcher.synced.wait(), 3)
        assert set(watcher.nodes) == {"edge-1", "edge-2"}
        assert watcher.nodes["edge-1"].addresses == ("10.0.0.1", "fd00::1", "203.0.113.5")
        assert watcher.nodes["edge-1"].pool == "pool-a" and watcher.nodes["edge-1"].ready
        assert watcher.nodes["edge-2"].pool == "pool-b" and not watcher.nodes["edge-2"].ready
        assert calls == [watcher.nodes]
        assert calls[0] is not watcher.nodes  # a copy
        await poll(lambda: fake.active_watches == 1, what="the watch")
    (listing,) = fake.node_requests(watch=False)
    assert listing.query["labelSelector"] == POOL
    watch = fake.node_requests(watch=True)[0].query
    assert watch["resourceVersion"] == str(fake.rv)
    assert watch["allowWatchBookmarks"] in ("true", "True") and watch["timeoutSeconds"] == "300"


async def test_watcher_selector(fake: FakeKube, api: Any) -> None:
    fake.add_node("edge-1", {POOL: "pool-a", "role": "edge"}, ["10.0.0.1"])
    fake.add_node("edge-2", {POOL: "pool-a"}, ["10.0.0.2"])
    fake.add_node("other", {"role": "edge"}, ["10.0.0.3"])
    watcher = NodeWatcher(api, POOL, selector="role=edge")
    async with running(watcher.run()):
        await asyncio.wait_for(watcher.synced.wait(), 3)
        assert set(watcher.nodes) == {"edge-1"}
        await poll(lambda: fake.active_watches == 1, what="the watch")
        fake.update_node("edge-2", labels={POOL: "pool-a", "role": "edge"})  # enters the selection
        await poll(lambda: set(watcher.nodes) == {"edge-1", "edge-2"}, what="edge-2 to enter")
        fake.update_node("edge-1", labels={POOL: "pool-a"})  # leaves it: the server sends DELETED
        await poll(lambda: set(watcher.nodes) == {"edge-2"}, what="edge-1 to leave")
        fake.update_node("other", labels={"role": "edge", "x": "y"})  # never selected
        await asyncio.sleep(0.1)
        assert set(watcher.nodes) == {"edge-2"}
    assert fake.node_requests(watch=False)[0].query["labelSelector"] == f"{POOL},role=edge"
    assert len(fake.node_requests(watch=False)) == 1


async def test_watch_events_without_relist(fake: FakeKube, api: Any) -> None:
    fake.add_node("edge-1", {POOL: "pool-a"}, ["10.0.0.1"])
    calls: list[dict[str, KubeNode]] = []
    watcher = NodeWatcher(api, POOL, on_change=calls.append)
    async with running(watcher.run()):
        await asyncio.wait_for(watcher.synced.wait(), 3)
        await poll(lambda: fake.active_watches == 1, what="the watch")
        fake.add_node("edge-2", {POOL: "pool-b"}, ["10.0.1.1"])
        await poll(lambda: "edge-2" in watcher.nodes, what="ADDED")
        fake.update_node("edge-1", addresses=["10.0.0.9"], ready=False)
        await poll(lambda: watcher.nodes["edge-1"].addresses == ("10.0.0.9",), what="MODIFIED")
        assert not watcher.nodes["edge-1"].ready
        fake.delete_node("edge-2")
        await poll(lambda: "edge-2" not in watcher.nodes, what="DELETED")
        assert [sorted(c) for c in calls] == [["edge-1"], ["edge-1", "edge-2"], ["edge-1", "edge-2"], ["edge-1"]]
        assert watcher.resource_version == str(fake.rv)
    assert len(fake.node_requests(watch=False)) == 1
    assert len(fake.node_requests(watch=True)) == 1
    assert watcher.lists == 1


async def test_bookmarks_and_rewatch(fake: FakeKube, api: Any) -> None:
    fake.add_node("edge-1", {POOL: "pool-a"}, ["10.0.0.1"])
    calls: list[dict[str, KubeNode]] = []
    watcher = NodeWatcher(api, POOL, on_change=calls.append, watch_timeout=1)
    async with running(watcher.run()):
        await asyncio.wait_for(watcher.synced.wait(), 3)
        listed_at = watcher.resource_version
        rv = fake.bump()  # something else changed in the cluster
        await poll(lambda: watcher.resource_version == str(rv), what="a bookmark")
        assert listed_at != str(rv)
        # the server ends the watch after timeoutSeconds; the watcher resumes from the bookmark's version
        await poll(lambda: len(fake.node_requests(watch=True)) >= 2, what="a second watch")
        assert fake.node_requests(watch=True)[1].query["resourceVersion"] == str(rv)
        fake.add_node("edge-2", {POOL: "pool-a"}, ["10.0.0.2"])
        await poll(lambda: "edge-2" in watcher.nodes, what="an event on the second watch")
    assert len(calls) == 2  # the list and edge-2; bookmarks are not changes
    assert len(fake.node_requests(watch=False)) == 1


async def test_compaction_relists(fake: FakeKube, api: Any) -> None:
    fake.add_node("edge-1", {POOL: "pool-a"}, ["10.0.0.1"])
    fake.add_node("edge-2", {POOL: "pool-a"}, ["10.0.0.2"])
    calls: list[dict[str, KubeNode]] = []
    watcher = NodeWatcher(api, POOL, on_change=calls.append, relist_backoff=0.1)
    async with running(watcher.run()):
        await asyncio.wait_for(watcher.synced.wait(), 3)
        await poll(lambda: fake.active_watches == 1, what="the watch")
        # changes the watch never delivers, then the history is compacted past them: ERROR 410 on the live watch
        fake.delete_node("edge-2")
        fake.add_node("edge-3", {POOL: "pool-b"}, ["10.0.1.3"])
        fake.compact()
        await poll(lambda: watcher.lists == 2, what="a relist")
        assert set(watcher.nodes) == {"edge-1", "edge-3"}
        assert watcher.nodes["edge-3"].pool == "pool-b"
        assert sorted(calls[-1]) == ["edge-1", "edge-3"]
        assert watcher.resource_version == str(fake.rv)
        # an HTTP 410 on the watch request itself also relists
        fake.fail_next("GET", "/api/v1/nodes", 410)
        fake.drop_watches()
        await poll(lambda: watcher.lists == 3, what="a relist after HTTP 410")
        fake.add_node("edge-4", {POOL: "pool-b"}, ["10.0.1.4"])
        await poll(lambda: "edge-4" in watcher.nodes, what="watching again")
    assert len(fake.node_requests(watch=False)) == 3


async def test_api_failures_recover(fake: FakeKube, api: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake.add_node("edge-1", {POOL: "pool-a"}, ["10.0.0.1"])
    fake.fail_next("GET", "/api/v1/nodes", 500)  # the first LIST fails
    watcher = NodeWatcher(api, POOL, relist_backoff=0.05)
    async with running(watcher.run()):
        await asyncio.wait_for(watcher.synced.wait(), 3)
        await poll(lambda: fake.active_watches == 1, what="the watch")
        # the watch breaks and the API server answers 500 twice: back off, then resume the watch (no relist)
        fake.fail_next("GET", "/api/v1/nodes", 500, times=2)
        fake.drop_watches()
        fake.add_node("edge-2", {POOL: "pool-a"}, ["10.0.0.2"])
        await poll(lambda: "edge-2" in watcher.nodes, what="recovery")
        assert watcher.lists == 1
    assert "node list failed" in caplog.text and "node watch failed" in caplog.text
    assert len(fake.node_requests(watch=False)) == 2  # the failed one and the good one


async def test_connection_refused_keeps_retrying(fake: FakeKube, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    closed = FakeKube()
    closed.port = port
    client = await api_client(closed.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        watcher = NodeWatcher(client, POOL, relist_backoff=0.05)
        async with running(watcher.run()) as task:
            await asyncio.sleep(0.3)
            assert not task.done() and not watcher.synced.is_set()
    finally:
        await client.close()


# -- ConfigMap ---------------------------------------------------------------------------------------------------


async def test_configmap_create_noop_update(fake: FakeKube, api: Any) -> None:
    pub = ConfigMapPublisher(api, NS, CM, "tunnel-nodes")
    assert await pub.publish("10.96.0.50 edge-1\n")
    cm = fake.configmaps[(NS, CM)]
    assert cm["data"] == {"tunnel-nodes": "10.96.0.50 edge-1\n"}
    assert cm["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "raven"}
    assert fake.requests[-1].query.get("fieldManager") == "raven"

    assert not await pub.publish("10.96.0.50 edge-1\n")
    assert [r.method for r in fake.requests if r.path.startswith(CM_PATH)] == ["GET", "POST", "GET"]

    rv = cm["metadata"]["resourceVersion"]
    assert await pub.publish("10.96.0.50 edge-1\n10.96.0.50 edge-2\n")
    put = fake.requests[-1]
    assert put.method == "PUT" and put.body["metadata"]["resourceVersion"] == rv
    assert fake.configmaps[(NS, CM)]["data"]["tunnel-nodes"].endswith("edge-2\n")


async def test_configmap_conflict_and_other_keys(fake: FakeKube, api: Any) -> None:
    fake.configmaps[(NS, CM)] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": CM, "namespace": NS, "uid": "u1", "resourceVersion": "5",
                     "creationTimestamp": "2024-01-01T00:00:00Z", "annotations": {"note": "kept"}},
        "data": {"Corefile": ".:53 {}", "tunnel-nodes": "old"},
    }
    fake.fail_next("PUT", f"{CM_PATH}/{CM}", 409)
    pub = ConfigMapPublisher(api, NS, CM, "tunnel-nodes", conflict_backoff=0.01)
    assert await pub.publish("new")
    cm = fake.configmaps[(NS, CM)]
    assert cm["data"] == {"Corefile": ".:53 {}", "tunnel-nodes": "new"}
    assert cm["metadata"]["annotations"] == {"note": "kept"} and cm["metadata"]["uid"] == "u1"
    assert [r.method for r in fake.requests] == ["GET", "PUT", "GET", "PUT"]

    fake.fail_next("PUT", f"{CM_PATH}/{CM}", 409, times=10)
    with pytest.raises(KubeError, match="still conflicting after 5 attempts"):
        await pub.publish("newer")
    fake._failures.clear()

    fake.fail_next("PUT", f"{CM_PATH}/{CM}", 403)
    with pytest.raises(KubeError, match="RBAC must allow verb 'update' on resource 'configmaps'"):
        await pub.publish("newer")


async def test_a_hosts_file_larger_than_a_configmap_is_never_written(fake: FakeKube, api: Any) -> None:
    pub = ConfigMapPublisher(api, NS, CM, "tunnel-nodes")
    assert await pub.publish("10.96.0.50 edge-1\n")
    requests = len(fake.requests)
    with pytest.raises(KubeError, match=r"would exceed the \d+-byte limit of a ConfigMap; not written"):
        await pub.publish("10.96.0.50 edge-1\n" * 70_000)  # about 1.2 MB
    assert len(fake.requests) == requests  # not even read: nothing was sent
    assert fake.configmaps[(NS, CM)]["data"] == {"tunnel-nodes": "10.96.0.50 edge-1\n"}  # the last good one stays


async def test_configmap_create_race(fake: FakeKube, api: Any) -> None:
    fake.fail_next("POST", CM_PATH, 409)  # someone else created it between our GET and POST
    pub = ConfigMapPublisher(api, NS, CM, "tunnel-nodes", conflict_backoff=0.01)
    assert await pub.publish("x")
    assert fake.configmaps[(NS, CM)]["data"] == {"tunnel-nodes": "x"}


# -- Lease -------------------------------------------------------------------------------------------------------


def _holder(fake: FakeKube, name: str = "raven-gateway") -> str | None:
    lease = fake.leases.get((NS, name))
    holder: str | None = lease["spec"].get("holderIdentity") if lease else None
    return holder


async def test_lease_one_leader_then_takeover(fake: FakeKube, api: Any) -> None:
    changes: dict[str, list[bool]] = {"a": [], "b": []}
    a = LeaseElector(api, NS, "raven-gateway", "a", duration=1.0, on_change=changes["a"].append)
    b = LeaseElector(api, NS, "raven-gateway", "b", duration=1.0, on_change=changes["b"].append)
    task_a = asyncio.create_task(a.run())
    task_b = asyncio.create_task(b.run())
    try:
        await poll(lambda: a.is_leader or b.is_leader, what="a leader")
        await asyncio.sleep(0.5)  # a few renewals: still exactly one
        assert a.is_leader != b.is_leader
        leader, follower = (a, b) if a.is_leader else (b, a)
        leader_task = task_a if leader is a else task_b
        assert _holder(fake) == leader.identity and follower.holder == leader.identity
        spec = fake.leases[(NS, "raven-gateway")]["spec"]
        assert spec["leaseDurationSeconds"] == 1 and spec["leaseTransitions"] == 0
        assert leader.leader_changed.is_set()

        leader_task.cancel()  # stops renewing without releasing
        with contextlib.suppress(asyncio.CancelledError):
            await leader_task
        assert not leader.is_leader
        stopped = time.monotonic()
        await poll(lambda: follower.is_leader, timeout=3, what="the takeover")
        assert time.monotonic() - stopped > 0.5  # not before the lease expired
        assert _holder(fake) == follower.identity
        assert fake.leases[(NS, "raven-gateway")]["spec"]["leaseTransitions"] == 1
        assert changes[leader.identity] == [True, False] and changes[follower.identity] == [True]
    finally:
        for task in (task_a, task_b):
            task.cancel()
        await asyncio.gather(task_a, task_b, return_exceptions=True)


async def test_lease_release_hands_over(fake: FakeKube, api: Any) -> None:
    a = LeaseElector(api, NS, "raven-gateway", "a", duration=3.0)
    async with running(a.run()) as task_a:
        await poll(lambda: a.is_leader, what="a to lead")
        b = LeaseElector(api, NS, "raven-gateway", "b", duration=3.0)
        async with running(b.run()):
            await poll(lambda: b.holder == "a", what="b to see a")
            task_a.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task_a
            released = time.monotonic()
            assert await a.release()
            assert _holder(fake) in (None, "b")
            await poll(lambda: b.is_leader, timeout=2.5, what="b to take over")
            assert time.monotonic() - released < 2.0  # well before the 3 s lease would have expired
            assert not await a.release()  # not ours any more


async def test_lease_conflict_and_errors_fail_safe(fake: FakeKube, api: Any) -> None:
    changes: list[bool] = []
    a = LeaseElector(api, NS, "raven-gateway", "a", duration=1.2, on_change=changes.append)
    async with running(a.run()):
        await poll(lambda: a.is_leader, what="a to lead")
        for method, status in (("PUT", 409), ("GET", 500)):  # a renewal loses a race; the API server fails
            history = changes.copy()
            fake.fail_next(method, f"{LEASE_PATH}/raven-gateway", status)

            def lost_and_regained(seen: int = len(history)) -> bool:
                return False in changes[seen:] and a.is_leader

            await poll(lost_and_regained, what=f"{status}: lost and regained")
        spec = fake.leases[(NS, "raven-gateway")]["spec"]
        assert spec["holderIdentity"] == "a" and spec["leaseTransitions"] == 0
