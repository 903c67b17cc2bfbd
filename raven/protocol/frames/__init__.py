"""The tunnel's frames, each frame's encoder beside its decoder: ``base.py`` (the header, types, codes, limits
and the pieces every frame uses), ``streams.py`` (OPEN, HEAD, DATA, END, RESET, WINDOW), ``control.py`` (stream
0: HELLO, WELCOME, REGISTER, REGISTERED, PING, PONG, DRAIN, GOAWAY, DATAGRAM, ROUTES). raven/protocol/wire.py
is the codec the rest of Raven uses: it re-exports these names and dispatches ``encode``/``decode`` by type."""
