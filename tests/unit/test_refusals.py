"""raven/refusals.py without sockets: every reason is a code with a fixed label, a status and a counter."""

from __future__ import annotations

import re
from http import HTTPStatus

import pytest

from gateway.registry import Registry, told
from raven.errors import RavenError
from raven.protocol import wire
from raven.refusals import RESET_REASON, Reason, Refusal, Where, reset_reason

# Label values as dashboards, rules and tests read them today: they must not change with a refactor.
FRONT_LABELS = {
    "bad-request", "auth", "duplicate-field", "port", "unknown-node", "method", "body-timeout", "direct-pool",
    "headers-too-large", "upstream", "unavailable", "not-settled", "node-busy", "client-share", "connect-cap",
    "connect-client-cap", "connection-over-capacity", "connection-client-cap", "timeout", "write-stall",
}
AGENT_LABELS = {"node", "port", "connect", "method", "target", "draining", "queue-full", "queue-timeout"}
REGISTRATION_LABELS = {
    "duplicate", "agent-node-cap", "node-cap", "hosts-budget", "invalid-name", "invalid-address", "reserved-suffix",
    "reserved-name", "reads-as-address", "pool-not-allowed", "no-node-object", "node-object-pool", "config-pool",
    "dotted-name", "claimed-by-other-pool", "bound-to-other-pool",
}
HANDSHAKE_LABELS = {
    "client certificate required", "unreadable client certificate", "not-an-agent-certificate", "invalid-identity",
    "gateway is draining", "no-hello", "bad-hello", "hello-agent-mismatch", "agent-session-cap", "session-cap",
    "session-rate", "version", "agent-version", "register-rate", "routes-rate",
}


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.name)
def test_every_reason_has_a_label_a_status_and_a_counter(reason: Reason) -> None:
    assert isinstance(reason.where, Where)
    assert reason.label and reason.label == reason.label.strip() and len(reason.label) <= 40
    assert re.fullmatch(r"[a-z0-9 -]+", reason.label), reason.label  # a fixed word, no request or peer text
    assert 400 <= reason.status <= 599 and HTTPStatus(reason.status)
    if reason.where is Where.AGENT:
        assert reason.reset_code is not None
        # What the gateway answers for the agent's reset is the reason's status.
        assert reset_reason(reason.reset_code).status == reason.status
    else:
        assert reason.reset_code is None


def test_the_label_values_are_the_ones_the_counters_have() -> None:
    by_where = {w: {r.label for r in Reason if r.where is w} for w in Where}
    assert by_where[Where.FRONT] == FRONT_LABELS
    assert by_where[Where.AGENT] == AGENT_LABELS
    assert by_where[Where.REGISTRATION] == REGISTRATION_LABELS
    assert by_where[Where.HANDSHAKE] == HANDSHAKE_LABELS


def test_a_label_names_one_reason_per_counter_but_auth() -> None:
    """Within one counter a label stands for one reason, except the credentials check: 401 and 407 are both
    counted as ``auth``."""
    for where in Where:
        labels = [r.label for r in Reason if r.where is where]
        repeated = {x for x in labels if labels.count(x) > 1}
        assert repeated == ({"auth"} if where is Where.FRONT else set()), (where, repeated)
    assert {Reason.AUTH_REQUIRED.status, Reason.PROXY_AUTH_REQUIRED.status} == {401, 407}


def test_a_refusal_carries_its_code_text_and_subject() -> None:
    ref = Refusal(Reason.NODE_BUSY, "node 'edge-1' already has 64 requests in flight (limit)", {"Retry-After": "1"},
                  node="edge-1", pool="pool-a")
    assert isinstance(ref, RavenError)
    assert (ref.status, ref.label, ref.text, str(ref)) == (503, "node-busy", ref.text, ref.text)
    assert (ref.node, ref.pool, ref.headers) == ("edge-1", "pool-a", {"Retry-After": "1"})
    assert ref.reset_code == wire.ResetCode.REFUSED  # a front-door reason has no reset code of its own
    assert Refusal(Reason.AGENT_QUEUE_FULL, "busy").reset_code == wire.ResetCode.LIMIT
    assert "NODE_BUSY" in repr(ref)


def test_every_reset_code_maps_to_a_front_door_reason() -> None:
    assert set(RESET_REASON) == set(wire.ResetCode)
    expected = {wire.ResetCode.TIMEOUT: 504, wire.ResetCode.DRAINING: 503, wire.ResetCode.LIMIT: 503}
    for code in wire.ResetCode:
        assert reset_reason(code).where is Where.FRONT
        assert reset_reason(code).status == expected.get(code, 502), code
    assert reset_reason(250) is Reason.UPSTREAM  # a code this release does not know


def test_registry_refusals_are_labelled_by_their_code_not_their_words() -> None:
    from tests.unit.test_registry import agent, node

    reg = Registry(max_nodes_per_agent=1)
    a = agent("a1", {"p"})
    reg.add_session(a)
    _, refused = reg.register(a, [node("edge-1", "p"), node("edge-1", "p"), node("kube-dns", "p"),
                                  node("edge-2", "other"), node("edge-3", "p")])
    reasons = {name: why.reason for name, why in refused}
    assert reasons == {"edge-1": Reason.DUPLICATE, "kube-dns": Reason.RESERVED_NAME,
                       "edge-2": Reason.POOL_NOT_ALLOWED, "edge-3": Reason.AGENT_NODE_CAP}
    assert all(isinstance(why, Refusal) and why.label == why.reason.label for _, why in refused)
    # The agent is told the text; the wire carries words, never the code.
    assert told(refused) == [(name, why.text) for name, why in refused]
    (answer,) = wire.split_registered([], told(refused))
    assert answer.refused == tuple((name, why.text) for name, why in refused)
