"""Registry: claims, refusals, session keys, selection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.registry import AgentSession, Registry, told
from raven.protocol import wire
from raven.refusals import Reason, Where


class FakeSession:
    def __init__(self, in_flight: int = 0) -> None:
        self.in_flight = in_flight
        self.closed = False
        self.usable = True  # OPEN, ids left (raven/protocol/state.py)


def agent(name: str, pools: set[str], sid: str = "s1", load: int = 0) -> AgentSession:
    fake: Any = FakeSession(load)
    return AgentSession(name, sid, frozenset(pools), fake)


def node(name: str, pool: str) -> wire.NodeInfo:
    return wire.NodeInfo(name, "10.0.0.1", pool)


def test_register_refuses_pool_outside_certificate_and_foreign_claims() -> None:
    reg = Registry()
    a = agent("a1", {"pool-a"})
    b = agent("b1", {"pool-b"})
    reg.add_session(a)
    reg.add_session(b)
    assert reg.register(b, [node("edge-b-1", "pool-b")]) == (["edge-b-1"], [])
    accepted, refused = reg.register(a, [node("edge-a-1", "pool-a"), node("edge-b-1", "pool-b"),
                                         node("Bad_Name", "pool-a")])
    assert accepted == ["edge-a-1"]
    reasons = dict(told(refused))
    assert "not in this agent's certificate (allowed: pool-a)" in reasons["edge-b-1"]
    assert "RFC 1123" in reasons["Bad_Name"]
    a2 = agent("a2", {"pool-a", "pool-b"})
    reg.add_session(a2)
    _, refused = reg.register(a2, [node("edge-b-1", "pool-a")])
    assert "already registered by pool 'pool-b' (agents: b1)" in refused[0][1].text


def test_removing_an_old_session_keeps_the_newer_one() -> None:
    reg = Registry()
    old = agent("a1", {"pool-a"}, sid="same")
    reg.add_session(old)
    reg.register(old, [node("edge-1", "pool-a")])
    new = agent("a1", {"pool-a"}, sid="same")
    assert reg.add_session(new) is old
    reg.register(new, [node("edge-1", "pool-a")])
    assert reg.remove_session(old) is False
    assert reg.lookup("edge-1").entry is not None and reg.lookup("edge-1").refusal is None
    assert reg.remove_session(new) is True
    refusal = reg.lookup("edge-1").refusal
    assert refusal is not None and refusal.reason is Reason.UNAVAILABLE and "no agent connected" in refusal.text


def test_reregistration_replaces_the_node_set() -> None:
    reg = Registry()
    a = agent("a1", {"pool-a"})
    reg.add_session(a)
    reg.register(a, [node("edge-1", "pool-a"), node("edge-2", "pool-a")])
    reg.register(a, [node("edge-2", "pool-a")])
    assert [e.name for e in reg.reachable_nodes()] == ["edge-2"] and reg.reachable_count() == 1
    # A withdrawn node is forgotten; a node whose agent merely disconnected is still known.
    assert [e.name for e in reg.known_nodes()] == ["edge-2"]
    reg.remove_session(a)
    assert [e.name for e in reg.known_nodes()] == ["edge-2"]
    assert reg.reachable_nodes() == [] and reg.reachable_count() == 0  # the count follows the change


def test_select_is_the_nodes_rendezvous_agent_while_it_is_usable() -> None:
    """Every request to a node goes through one agent (gateway/rendezvous.py: the same on every replica), however
    busy; the next by weight when it drains or failed the request; a draining agent never."""
    reg = Registry()
    sessions = [agent(f"a{i}", {"p"}, str(i), load=i) for i in range(3)]
    sessions[2].session.usable = False  # type: ignore[misc]  # a FakeSession: the agent said DRAIN
    for s in sessions:
        reg.add_session(s)
        reg.register(s, [node(f"edge-{k}", "p") for k in range(40)])
    chosen = set()
    for k in range(40):
        entry = reg.lookup(f"edge-{k}").entry
        assert entry is not None
        first = reg.select(entry)
        assert first is not None and first is not sessions[2] and all(reg.select(entry) is first for _ in range(5))
        second = reg.select(entry, exclude=[first])
        assert second is not None and second not in (first, sessions[2])
        assert reg.select(entry, exclude=[first, second]) is None
        chosen.add(first.agent)
    assert chosen == {"a0", "a1"}  # the nodes are shared, not all on the idle one
    unknown = reg.lookup("edge-x")
    assert unknown.entry is None and unknown.refusal is not None and unknown.refusal.reason is Reason.UNKNOWN_NODE


def test_pool_binding_survives_a_blip_and_reserved_names_are_refused() -> None:
    reg = Registry(rebind_after=3600)
    b = agent("b1", {"pool-b"})
    reg.add_session(b)
    reg.register(b, [node("edge-b-1", "pool-b")])
    reg.remove_session(b)  # pool-b's agent blips
    rogue = agent("a1", {"pool-a"})
    reg.add_session(rogue)
    accepted, refused = reg.register(rogue, [node("edge-b-1", "pool-a"), node("kubernetes", "pool-a"),
                                             node("db.default.svc", "pool-a"), node("x.cluster.local", "pool-a")])
    assert accepted == []
    reasons = dict(told(refused))
    assert "bound to pool 'pool-b'" in reasons["edge-b-1"]
    assert all("reserved name" in reasons[n] for n in ("kubernetes", "db.default.svc", "x.cluster.local"))
    # pool-b comes back and gets its node again.
    b2 = agent("b1", {"pool-b"}, sid="s2")
    reg.add_session(b2)
    assert reg.register(b2, [node("edge-b-1", "pool-b")]) == (["edge-b-1"], [])
    # After the binding expires, another pool may take a node nobody holds.
    reg.remove_session(b2)
    reg.rebind_after = 0
    assert reg.register(rogue, [node("edge-b-1", "pool-a")]) == (["edge-b-1"], [])


def test_registration_is_capped() -> None:
    reg = Registry(max_nodes_per_agent=2)
    a = agent("a1", {"p"})
    reg.add_session(a)
    accepted, refused = reg.register(a, [node(f"edge-{i}", "p") for i in range(5)])
    assert len(accepted) == 2 and len(refused) == 3
    assert "agent a1 may register at most 2 nodes" in refused[0][1].text


def test_the_node_cap_counts_per_agent_identity_not_per_session() -> None:
    """Three sessions of one agent cannot register three times its cap; the same names across its
    sessions (one per gateway replica, or a reconnect) count once."""
    reg = Registry(max_nodes_per_agent=3)
    sessions = [agent("a1", {"p"}, sid=f"s{i}") for i in range(3)]
    for i, s in enumerate(sessions):
        reg.add_session(s)
        accepted, refused = reg.register(s, [node(f"edge-{i}-{j}", "p") for j in range(3)])
        if i == 0:
            assert len(accepted) == 3 and not refused
        else:
            assert accepted == [] and len(refused) == 3
    again = agent("a1", {"p"}, sid="s9")  # the same names again from another session: allowed
    reg.add_session(again)
    assert reg.register(again, [node(f"edge-0-{j}", "p") for j in range(3)])[1] == []
    other = agent("a2", {"p"})  # another identity has its own cap
    reg.add_session(other)
    assert len(reg.register(other, [node(f"edge-x-{j}", "p") for j in range(3)])[0]) == 3
    assert len(reg.nodes) == 6


def test_total_node_cap_and_hosts_budget() -> None:
    reg = Registry(max_nodes_total=4)
    a, b = agent("a1", {"p"}), agent("b1", {"p"})
    reg.add_session(a)
    reg.add_session(b)
    assert len(reg.register(a, [node(f"edge-a-{j}", "p") for j in range(3)])[0]) == 3
    accepted, refused = reg.register(b, [node(f"edge-b-{j}", "p") for j in range(3)])
    assert len(accepted) == 1 and "max_nodes_total" in refused[0][1].text
    # The hosts file budget: each name costs len(name) + 12 bytes here; room for exactly two names.
    reg = Registry(hosts_budget=2 * (len("edge-0") + 12), hosts_cost=lambda n: len(n) + 12)
    reg.add_session(a)
    accepted, refused = reg.register(a, [node(f"edge-{j}", "p") for j in range(3)])
    assert accepted == ["edge-0", "edge-1"]
    assert "the hosts file would exceed" in refused[0][1].text
    reg.register(a, [node("edge-0", "p")])  # edge-1 withdrawn: its bytes come back
    assert reg.register(a, [node("edge-0", "p"), node("edge-2", "p")])[1] == []


def test_a_fresh_registration_forgets_nodes_that_left_the_pool() -> None:
    reg = Registry()
    a = agent("a1", {"p"})
    reg.add_session(a)
    reg.register(a, [node("edge-1", "p"), node("edge-2", "p")])
    reg.remove_session(a)  # the agent restarts ...
    a2 = agent("a1", {"p"}, sid="s2")
    reg.add_session(a2)
    reg.register(a2, [node("edge-1", "p")])  # ... and edge-2 is no longer in its pool
    assert [e.name for e in reg.known_nodes()] == ["edge-1"]
    # A node still claimed by another live agent of the pool is kept.
    b = agent("b1", {"p"}, sid="s3")
    reg.add_session(b)
    reg.register(b, [node("edge-1", "p"), node("edge-3", "p")])
    reg.register(a2, [node("edge-1", "p")])
    assert [e.name for e in reg.known_nodes()] == ["edge-1", "edge-3"]


def test_node_objects_are_the_authority_for_pools() -> None:
    reg = Registry()
    reg.authority = {"edge-1": "pool-a", "other-1": "pool-b"}
    a = agent("a1", {"pool-a"})
    reg.add_session(a)
    accepted, refused = reg.register(a, [node("edge-1", "pool-a"), node("ghost-1", "pool-a")])
    assert accepted == ["edge-1"]
    assert "no edge Node object" in dict(told(refused))["ghost-1"]
    wide = agent("w1", {"pool-a", "pool-b"})
    reg.add_session(wide)
    _, refused = reg.register(wide, [node("other-1", "pool-a")])
    assert "the Node object puts it in pool 'pool-b'" in refused[0][1].text


def test_an_agent_cannot_erase_nodes_that_another_agent_lists() -> None:
    reg = Registry()
    a1, a2 = agent("a1", {"p", "q"}, sid="1"), agent("a2", {"p"}, sid="2")
    for s in (a1, a2):
        reg.add_session(s)
    reg.register(a1, [node("edge-1", "p")])
    reg.register(a2, [node("edge-9", "p")])
    reg.remove_session(a2)  # a2 blips
    reg.register(a1, [node("edge-1", "p")])  # a1 re-registers its own list
    assert [e.name for e in reg.known_nodes()] == ["edge-1", "edge-9"]
    # Both agents restart without edge-1: only then does it leave.
    b = agent("b1", {"p"}, sid="3")
    reg.add_session(b)
    reg.register(b, [node("edge-1", "p")])
    reg.remove_session(a1)
    a1b = agent("a1", {"p"}, sid="4")
    reg.add_session(a1b)
    reg.register(a1b, [])
    assert "edge-1" in [e.name for e in reg.known_nodes()]  # b still holds it
    reg.remove_session(b)
    b2 = agent("b1", {"p"}, sid="5")
    reg.add_session(b2)
    reg.register(b2, [])
    assert [e.name for e in reg.known_nodes()] == ["edge-9"]


def test_dotted_names_need_an_allowed_suffix_or_a_node_object() -> None:
    reg = Registry(name_suffixes=(".edge.example.com",))
    a = agent("a1", {"p"})
    reg.add_session(a)
    accepted, refused = reg.register(a, [node("registry.k8s.io", "p"), node("gpu-1.edge.example.com", "p"),
                                         node("gpu-2", "p")])
    assert accepted == ["gpu-1.edge.example.com", "gpu-2"]
    assert "dotted names can only be claimed" in refused[0][1].text


def test_node_objects_arriving_late_reevaluate_and_evict_wrong_claims() -> None:
    reg = Registry()
    rogue = agent("b1", {"pool-b"}, sid="1")
    owner = agent("a1", {"pool-a"}, sid="2")
    for s in (rogue, owner):
        reg.add_session(s)
    reg.register(rogue, [node("gpu-a-1", "pool-b")])  # before any authority: accepted
    _, refused = reg.register(owner, [node("gpu-a-1", "pool-a")])
    assert "already registered by pool 'pool-b'" in refused[0][1].text
    results = {s.agent: (acc, ref) for s, acc, ref in reg.set_authority({"gpu-a-1": "pool-a"})}
    assert results["a1"] == (["gpu-a-1"], [])
    assert "the Node object puts it in pool 'pool-a'" in results["b1"][1][0][1].text
    entry = reg.lookup("gpu-a-1").entry
    assert entry is not None and entry.pool == "pool-a" and entry.sessions == [owner]
    assert reg.set_authority({"gpu-a-1": "pool-a"}) == []  # unchanged: nothing re-evaluated


def test_an_address_that_is_not_an_ip_or_host_name_is_refused() -> None:
    reg = Registry()
    a = agent("a1", {"p"})
    reg.add_session(a)
    ok = [wire.NodeInfo("n1", "10.0.0.1", "p"), wire.NodeInfo("n2", "fe80::1%eth0", "p"),
          wire.NodeInfo("n3", "gpu-3.edge.example", "p")]
    bad = [wire.NodeInfo("n4", "x" * 254, "p"), wire.NodeInfo("n5", "", "p"), wire.NodeInfo("n6", "a b", "p"),
           wire.NodeInfo("n7", "10.0.0.1\n", "p")]
    accepted, refused = reg.register(a, ok + bad)
    assert accepted == ["n1", "n2", "n3"]
    assert [n for n, _ in refused] == ["n4", "n5", "n6", "n7"]
    assert all(r.reason is Reason.INVALID_ADDRESS for _, r in refused)
    assert all(r.text.startswith("address is not an IP address or host name") for _, r in refused)


def test_every_refusal_has_a_fixed_label() -> None:
    reg = Registry(max_nodes_per_agent=1, hosts_budget=10, hosts_cost=lambda n: 100)
    a = agent("a1", {"p"})
    reg.add_session(a)
    infos = [node("edge-1", "p"), node("edge-1", "p"), node("Bad_Name!", "p"), node("x.local", "p"),
             node("edge-2", "other"), wire.NodeInfo("edge-3", "not an address!", "p")]
    _, refused = reg.register(a, infos)
    assert {r.reason for _, r in refused} == {Reason.HOSTS_BUDGET, Reason.INVALID_NAME, Reason.RESERVED_SUFFIX,
                                              Reason.POOL_NOT_ALLOWED, Reason.INVALID_ADDRESS}, refused
    assert all(r.reason.where is Where.REGISTRATION and r.label == r.reason.label for _, r in refused)


def test_a_node_whose_agents_left_stays_a_discovery_target_while_bound(tmp_path: Path) -> None:
    """A cut uplink: the node stays in /sd (answered 503, so Prometheus records up == 0 and scrapes it again at
    its next interval) until ``rebind_after``; a withdrawn node leaves at once."""
    from gateway import discovery
    from gateway.pools import Pools
    from tests.unit.test_pools import gateway_config

    reg = Registry(rebind_after=60)
    a = agent("a1", {"pool-a"})
    reg.add_session(a)
    reg.register(a, [node("edge-1", "pool-a"), node("edge-2", "pool-a")])
    reg.register(a, [node("edge-1", "pool-a")])  # edge-2 withdrawn
    reg.remove_session(a)
    released = reg.nodes["edge-1"].released_at
    assert released is not None and reg.reachable_nodes() == []
    pools = Pools(gateway_config(tmp_path))
    query = discovery.SdQuery((9400,), frozenset(), frozenset())
    _, views = reg.node_views()
    groups, expires = discovery.groups(views.values(), pools, query, released + 1, 60)
    assert discovery.groups(views.values(), pools, query, released + 61, 60)[0] == []  # no longer bound
    assert [(g["targets"], g["labels"]["__meta_raven_connected"], g["labels"]["__meta_raven_agents"])
            for g in groups] == [(["edge-1:9400"], "false", "")]
    assert expires == released + 60  # the page says when the node stops being a target
    assert discovery.groups(views.values(), pools, query, released + 61, 60) == ([], float("inf"))
    b = agent("a2", {"pool-a"}, sid="s2")
    reg.add_session(b)
    reg.register(b, [node("edge-1", "pool-a")])
    _, views = reg.node_views()
    groups, _ = discovery.groups(views.values(), pools, query, released + 1, 60)
    assert [(g["labels"]["__meta_raven_connected"], g["labels"]["__meta_raven_agents"]) for g in groups] == [
        ("true", "a2")]


def test_a_node_the_configuration_places_in_a_pool_is_refused_to_every_other_pool() -> None:
    """Issue 29 item 1: an agent of tunnel pool pool-s claims the nodes the gateway's configuration lists under a
    direct and a layer-3 pool (one of them without an address). Each claim is refused with its reason, naming the
    owning pool; the registry holds none of them; the agent's own node is accepted."""
    reg = Registry()
    reg.placed = {"direct-1": "pool-d", "direct-2": "pool-d", "l3-node-1": "pool-l"}
    rogue = agent("s2", {"pool-s"})
    reg.add_session(rogue)
    claims = [node("direct-1", "pool-s"), wire.NodeInfo("direct-2", "direct-2", "pool-s"),
              node("l3-node-1", "pool-s"), node("edge-s-1", "pool-s")]
    accepted, refused = reg.register(rogue, claims)
    assert accepted == ["edge-s-1"]
    assert [(name, r.reason, r.pool) for name, r in refused] == [
        ("direct-1", Reason.CONFIG_POOL, "pool-d"), ("direct-2", Reason.CONFIG_POOL, "pool-d"),
        ("l3-node-1", Reason.CONFIG_POOL, "pool-l")]
    assert refused[0][1].text == "the gateway's configuration lists it under pool 'pool-d' (pools.pool-d.nodes), " \
                                 "not 'pool-s'"
    assert refused[0][1].reason.where is Where.REGISTRATION and refused[0][1].status == 409
    for name in ("direct-1", "direct-2", "l3-node-1"):
        assert reg.lookup(name).entry is None
    assert (rogue.refused_count, [n for n, _ in rogue.refused_sample]) == (3, ["direct-1", "direct-2", "l3-node-1"])
    # Kubernetes does not change it: the configuration is the operator's word.
    reg.authority = {"direct-1": "pool-s", "edge-s-1": "pool-s"}
    accepted, refused = reg.register(rogue, claims[:1])
    assert accepted == [] and refused[0][1].reason is Reason.CONFIG_POOL
    # The owning pool's own agent may register it (its pool is reached directly: the front end still refuses it).
    reg.authority = None
    owner = agent("d1", {"pool-d"})
    reg.add_session(owner)
    assert reg.register(owner, [node("direct-1", "pool-d")]) == (["direct-1"], [])
    assert owner.refused_count == 0 and owner.refused_sample == ()


def test_a_reload_that_places_a_node_evicts_another_pools_claim() -> None:
    """A node claimed by pool-s before the configuration listed it under pool-d: the reload takes it away from
    pool-s (the agent is told), and pool-d's agent, refused until then, gets it."""
    reg = Registry()
    owner = agent("d1", {"pool-d"}, sid="1")
    rogue = agent("s2", {"pool-s"}, sid="2")
    for s in (owner, rogue):
        reg.add_session(s)
    reg.register(rogue, [node("direct-1", "pool-s")])
    _, refused = reg.register(owner, [node("direct-1", "pool-d")])
    assert refused[0][1].reason is Reason.CLAIMED_BY_OTHER_POOL
    results = {s.agent: (acc, ref) for s, acc, ref in reg.set_placed({"direct-1": "pool-d"})}
    assert results["d1"] == (["direct-1"], [])
    assert results["s2"][0] == [] and results["s2"][1][0][1].reason is Reason.CONFIG_POOL
    entry = reg.lookup("direct-1").entry
    assert entry is not None and entry.pool == "pool-d" and entry.sessions == [owner]
    assert rogue.nodes == set()
    assert reg.set_placed({"direct-1": "pool-d"}) == []  # unchanged: nothing re-evaluated
