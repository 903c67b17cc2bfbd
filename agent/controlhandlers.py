"""What the agent does with a gateway's control frames (REGISTERED, ROUTES, DRAIN): one table
(raven/protocol/control.py) for every session; anything else a gateway sends on stream 0 is ignored."""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

from agent.layer3 import AgentLayer3
from raven.lograte import RateLimitedLog
from raven.ops.metrics import AgentMetrics
from raven.protocol import wire
from raven.protocol.control import ControlDispatcher
from raven.transport.tunnel import Tunnel


class GatewayLink(NamedTuple):
    """A session to one gateway replica, as the handlers see it."""

    session: Tunnel
    replica: str


class GatewayControl:
    def __init__(self, refused: dict[str, str], metrics: AgentMetrics, layer3: AgentLayer3 | None,
                 log: RateLimitedLog) -> None:
        self.refused = refused  # the agent's: node -> why a gateway refused it (the latest answers)
        self.metrics = metrics
        self.layer3 = layer3
        self._log = log  # what a gateway sends is logged at most once a minute per replica and kind
        self.table: ControlDispatcher[GatewayLink] = ControlDispatcher(lambda link, frame: None)
        self.table.on(wire.Registered, self._on_registered)
        self.table.on(wire.Routes, self._on_routes)
        self.table.on(wire.Drain, self._on_drain)

    def attach(self, session: Tunnel, replica: str) -> None:
        """Send ``session``'s control frames (from replica ``replica``) through the table."""
        session.on_control = functools.partial(self.table.dispatch, GatewayLink(session, replica))

    def _on_registered(self, link: GatewayLink, frame: wire.Registered) -> None:
        # A large answer comes as several REGISTERED frames, each with part of it.
        self.refused.update(frame.refused)
        self.metrics.nodes_refused.set(len(self.refused))
        peer = f"gateway {link.replica}"
        for name, reason in frame.refused:
            self._log.log(logging.ERROR, peer, "refused", "gateway %s refused node %r: %s", link.replica, name, reason)
        self._log.info(peer, "registered", "gateway %s accepted %d node(s), refused %d", link.replica,
                       len(frame.accepted), len(frame.refused))

    def _on_routes(self, link: GatewayLink, frame: wire.Routes) -> None:
        if self.layer3 is not None:
            self.layer3.on_routes(link.session, frame)

    def _on_drain(self, link: GatewayLink, frame: wire.Drain) -> None:
        # The session is DRAINING (the core's state); the gateway finishes its streams in flight, then closes;
        # we redial after that.
        self._log.info(f"gateway {link.replica}", "drain", "gateway %s is draining: %s", link.replica, frame.reason)
