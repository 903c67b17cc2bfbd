"""The tunnel protocol's sans-I/O core: no asyncio, no aiohttp; bytes in, events out, ``data_to_send()`` out.

- ``wire``: the codec (frames, batched messages from version 2, strict and bounded decoding); each frame's
  encoder and decoder are in ``frames``;
- ``session``: the session state machine (stream table and ids, heartbeat deadlines driven by a ``now`` passed in);
- ``state``: the session's life as named states and the table of their transitions;
- ``stream``: one stream's halves as a transition table, its flow accounts and errors;
- ``outbox``: what a session has to send, batched into messages (frames first, then layer-3 packets);
- ``events``: what ``session`` reports;
- ``handshake``: HELLO/WELCOME driven sans I/O (``ClientHandshake``, ``ServerHandshake``), the version both sides
  speak, and the ready session each side gets;
- ``control``: one dispatcher for control frames (a table by frame type);
- ``flow``: per-stream credit accounting (windows);
- ``headers``: the HTTP side of the contract (which headers cross the tunnel, which are Raven's own).

raven/transport/ runs a session over an asyncio WebSocket. See docs/protocol.md.
"""
