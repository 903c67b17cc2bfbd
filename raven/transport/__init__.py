"""The thin asyncio layer under the services: the sans-I/O session (raven/protocol/) run over a WebSocket.

- ``websocket``: an aiohttp WebSocket (either side) as a message sink and a message source;
- ``connect``: ``connect()`` (the agent) and ``accept()`` (the gateway): the handshake, then a ready tunnel;
- ``tunnel``: :class:`Tunnel` around a ready core: one reader feeding it, one writer sending everything pending
  per turn of the loop, one timer at the core's next deadline (the heartbeat);
- ``stream``: :class:`Stream`, whose reads and writes await the tunnel's events (through the ``Link`` surface);
- ``pacer``: how much the tunnel's writer lets the kernel hold unsent on the TCP socket (``TCP_NOTSENT_LOWAT``);
- ``tls``: TLS contexts of both sides and the certificate reloader.

The HTTP listeners' hardening (guard, accept loop, eviction) is raven/http/, not part of the tunnel.
"""
