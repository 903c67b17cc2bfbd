"""The thin asyncio layer under the services: the sans-I/O session (raven/protocol/) run over a WebSocket.

- ``websocket``: an aiohttp WebSocket (either side) as a message sink and a message source;
- ``session``: :class:`Session`, one reader feeding the protocol state machine, one writer sending everything
  pending per turn of the loop;
- ``stream``: :class:`Stream`, whose reads and writes await the session's events;
- ``heartbeat``: one timer per event loop that drives every session's heartbeat.
"""
