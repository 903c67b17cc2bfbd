"""The tunnel protocol's sans-I/O core: no asyncio, no aiohttp; bytes in, events out, ``data_to_send()`` out.

- ``wire``: the codec (frames, batched messages from version 2, strict and bounded decoding);
- ``session``: the session state machine (stream table and ids, each stream's halves as a transition table,
  flow-control accounting, heartbeat deadlines driven by a ``now`` passed in, outgoing frames);
- ``events``: what ``session`` reports;
- ``handshake``: HELLO/WELCOME, the version both sides speak, what each side builds its session with;
- ``flow``: per-stream credit accounting (windows);
- ``headers``: the HTTP side of the contract (which headers cross the tunnel, which are Raven's own).

raven/transport/ runs a session over an asyncio WebSocket. See docs/protocol.md.
"""
