"""The tunnel protocol's sans-I/O core: no asyncio, no aiohttp; bytes in, frames and events out.

- ``wire``: the codec (one frame per WebSocket message, strict and bounded decoding);
- ``flow``: per-stream credit accounting (windows);
- ``headers``: the HTTP side of the contract (which headers cross the tunnel, which are Raven's own).

The session state machine still lives in ``raven/mux.py`` beside asyncio; moving it here is issue 11's next
step. See docs/protocol.md.
"""
