"""The HTTP listeners' hardening, apart from the tunnel: what the front end, the ops listeners and the agent's
upstream client share about plain HTTP.

- ``listener``: :class:`GuardedSite`, the accept loop whose connections go through the guard, and the process's
  descriptor budget;
- ``guard``: :class:`ConnectionGuard`, deadlines per connection phase and caps per client and in total;
- ``clock``: the one timer per connection that every deadline of a front-end request runs on;
- ``h1`` and ``h1server``: the front port's lean HTTP/1.1 server (llhttp; parsing decisions apart from asyncio);
- ``call``: what a front-end handler sees of a request and how it answers, on either front server;
- ``eviction``: which waiting connection a full ops listener closes to admit a new one;
- ``quiet``: whether an idle keep-alive connection may be closed without a reset;
- ``readbuffer``: the read buffer all guarded connections of one thread share;
- ``parsererrors``: the lines about requests a parser rejected, one short line per client a minute;
- ``coding``: content codings (does a client accept gzip; the deflate both services use).
"""
