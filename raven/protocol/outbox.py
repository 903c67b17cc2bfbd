"""What a session has to send, in which order it leaves, and as which WebSocket messages.

The backlog of a session is kept here, not below it (the transport hands the kernel only what it can send soon:
raven/transport/pacer.py), so that the order is decided at the last moment, when the transport asks for
``budget`` bytes (:meth:`Outbox.take`):

1. control frames first, all of them: OPEN, HEAD, WINDOW, PING/PONG, END and RESET of streams with nothing queued,
   the service's control frames. They are small and what they start or keep alive is what waits on them;
2. then the DATA of the streams, in turns: a turn serves one stream at most ``QUANTUM`` bytes while another
   waits (the only one waiting takes what the budget has left). Small streams go first, the least served first
   (a scrape's page, a response's first bytes, before a download that has sent megabytes). A stream that has
   sent ``BULK_AFTER`` bytes counts as bulk; bulk streams and layer-3 packets (DATAGRAM frames, one flow) take
   turns in round robin, and they are owed one turn after every ``SMALL_TURNS`` small ones, so a steady flow
   of new small streams slows them but never stops them;
3. last, GOAWAY (it ends the session: what was queued before it still goes).

Within one stream the order is kept: its END or RESET waits behind its queued DATA (a response is never cut by
its own end). A stream reset before its data left loses that data (the peer would discard it).

Version 1: one frame per message. Version 2: frames in as few messages of at most ``BATCH_BUDGET`` bytes as fit
(length-prefixed). Payloads are referenced, not copied, until then (a mutable buffer is copied when queued); the
one copy is the message's join. Packets are bounded by ``DATAGRAM_QUEUE`` (more are refused: IP semantics).
"""

from __future__ import annotations

import collections
import heapq
from typing import Final

from raven.protocol import wire

_Out = tuple[bytes, "bytes | memoryview | None"]  # an encoded head, and a payload to follow it (or None)
_DATAGRAMS: Final = 0  # the flow id of layer-3 packets (stream ids start at 1)


def _readonly(data: bytes | bytearray | memoryview) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    return view if view.readonly else memoryview(bytes(view))


class _Flow:
    """One stream's queued frames (or the packets'): DATA as (payload, fin), any other frame encoded."""

    __slots__ = ("ended", "entry", "queue", "queued", "sent")

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[memoryview, bool] | _Out] = collections.deque()
        self.queued = 0  # bytes queued (headers included)
        self.sent = 0  # payload bytes taken so far: the stream's place in line
        self.entry = -1  # the turn of its entry in the ready heap (-1: none)
        self.ended = False  # the stream ended (or this is the packets' flow): forgotten once its queue is empty


class Outbox:
    __slots__ = ("_bulk", "_data_head", "_flows", "_frames", "_last", "_ready", "_small_turns", "_turn", "batched",
                 "pending_bytes")

    BATCH_BUDGET: Final = 128 * 1024  # bytes of frames per batched message (every peer accepts 256 KiB)
    DATAGRAM_QUEUE: Final = 256 * 1024  # bytes of layer-3 packets waiting to go; more are refused, never queued
    QUANTUM: Final = 16 * 1024  # payload bytes one stream sends per turn while another waits
    BULK_AFTER: Final = 256 * 1024  # a stream that has sent this much is bulk (round robin with the packets)
    SMALL_TURNS: Final = 4  # small turns in a row while bulk waits; then bulk has one
    MIN_PART: Final = 1024  # the smallest part a DATA frame is split into to fit a budget

    def __init__(self, batched: bool) -> None:
        self.batched = batched
        self._data_head = 10 if batched else 6  # a DATA frame's header (and its length prefix)
        # The lists exist only while they hold something: an idle session's outbox keeps none (four empty lists
        # were a quarter of a kilobyte per session).
        self._frames: list[_Out] | None = None  # control frames: everything queued leaves at the next take
        self._last: list[_Out] | None = None  # GOAWAY
        self._flows: dict[int, _Flow] = {}  # per stream while it lives (and the packets' flow)
        self._ready: list[tuple[int, int, int]] | None = None  # (place in line, turn, flow id): small flows queued
        self._bulk: list[tuple[int, int, int]] | None = None  # the same for bulk flows (their place: the turn)
        self._small_turns = 0  # small turns served in a row while bulk waited
        self._turn = 0
        self.pending_bytes = 0  # bytes queued and not yet taken

    # ------------------------------------------------------------ queueing

    def _encoded(self, frame: wire.Frame) -> _Out:
        encoded = wire.encode(frame)
        self.pending_bytes += len(encoded) + (4 if self.batched else 0)
        return (wire.length_prefix(len(encoded)), encoded) if self.batched else (encoded, None)

    def frame(self, frame: wire.Frame) -> None:
        """A control frame (or a stream's frame that need not wait for its data): it leaves at the next take."""
        out = self._encoded(frame)  # encoding raises for unencodable input before anything is queued
        if isinstance(frame, wire.GoAway):
            if self._last is None:
                self._last = []
            self._last.append(out)
        elif self._frames is None:
            self._frames = [out]
        else:
            self._frames.append(out)

    def after_data(self, stream_id: int, frame: wire.Frame) -> None:
        """A stream's END or RESET: behind its queued DATA if it has any, else at the next take."""
        flow = self._flows.get(stream_id)
        if flow is None or not flow.queue:
            self.frame(frame)
            return
        out = self._encoded(frame)
        flow.queue.append(out)
        flow.queued += len(out[0]) + (len(out[1]) if out[1] is not None else 0)

    def data(self, stream_id: int, chunk: memoryview, fin: bool) -> None:
        """A DATA frame's payload by reference (copied here only if the buffer is mutable); encoded when taken."""
        self._push(stream_id, (_readonly(chunk), fin), self._data_head + len(chunk))

    def datagram(self, packet: bytes | bytearray | memoryview) -> bool:
        """Queue one IP packet (version 2 only); False if it does not fit the queue."""
        size = wire.HEADER_SIZE + len(packet) + 4
        flow = self._flows.get(_DATAGRAMS)
        if not self.batched or (flow.queued if flow else 0) + size > self.DATAGRAM_QUEUE:
            return False
        view = _readonly(packet)
        self._push(_DATAGRAMS, (wire.datagram_header(len(view)), view), size)
        return True

    def _push(self, flow_id: int, item: tuple[memoryview, bool] | _Out, size: int) -> None:
        flow = self._flows.get(flow_id)
        if flow is None:
            flow = self._flows[flow_id] = _Flow()
            if flow_id == _DATAGRAMS:
                flow.sent = self.BULK_AFTER  # layer 3 is bulk
                flow.ended = True
        flow.queue.append(item)
        flow.queued += size
        self.pending_bytes += size
        if flow.entry < 0:
            self._enter(flow_id, flow)

    def _enter(self, flow_id: int, flow: _Flow) -> None:
        flow.entry = self._turn
        entry = (min(flow.sent, self.BULK_AFTER), self._turn, flow_id)
        if flow.sent >= self.BULK_AFTER:
            if self._bulk is None:
                self._bulk = []
            heapq.heappush(self._bulk, entry)
        else:
            if self._ready is None:
                self._ready = []
            heapq.heappush(self._ready, entry)
        self._turn += 1

    def queued(self, stream_id: int) -> int:
        """Bytes of this stream still queued."""
        flow = self._flows.get(stream_id)
        return flow.queued if flow is not None else 0

    def drop(self, stream_id: int) -> None:
        """Forget a stream: what it still had queued is not sent (it was reset)."""
        flow = self._flows.pop(stream_id, None)
        if flow is not None:
            self.pending_bytes -= flow.queued
        ready, bulk = self._ready, self._bulk
        if (len(ready) if ready else 0) + (len(bulk) if bulk else 0) > 2 * len(self._flows) + 64:
            flows = self._flows  # entries of dropped flows: bounded
            for heap in (ready, bulk):
                if heap is not None:
                    heap[:] = [e for e in heap if (f := flows.get(e[2])) is not None and f.entry == e[1]]
                    heapq.heapify(heap)
            self._ready = ready or None
            self._bulk = bulk or None

    def forget(self, stream_id: int) -> None:
        """The stream ended: its account goes once its queued frames have left."""
        flow = self._flows.get(stream_id)
        if flow is not None:
            if flow.queue:
                flow.ended = True
            else:
                del self._flows[stream_id]

    def drop_datagrams(self) -> None:
        self.drop(_DATAGRAMS)

    # ------------------------------------------------------------ taking

    def take(self, budget: int | None = None) -> list[bytes]:
        """What leaves now, as WebSocket messages: every control frame, then stream DATA and packets in their
        order of service until ``budget`` bytes (None: everything), then GOAWAY once nothing else waits."""
        everything = budget is None or budget >= self.pending_bytes  # nothing waits: no turns, no frame split
        out = self._frames
        self._frames = None
        if out is None:
            out = []
        size = sum(len(h) + (len(b) if b is not None else 0) for h, b in out)
        left = (1 << 62) if budget is None else budget - size
        while left > 0:
            small, bulk = self._ready, self._bulk  # read again each turn: serving a flow may make a heap
            if not small and not bulk:
                break
            bulk_turn = bool(bulk) and (not small or self._small_turns >= self.SMALL_TURNS)
            heap = bulk if bulk_turn else small
            if heap is None:
                break  # never: the heap taken from has entries
            _, turn, flow_id = heapq.heappop(heap)
            flow = self._flows.get(flow_id)
            if flow is None or flow.entry != turn:
                continue  # dropped (reset) or entered again since
            self._small_turns = 0 if bulk_turn or not bulk else self._small_turns + 1
            flow.entry = -1
            quantum = left if everything or not (small or bulk) else min(left, self.QUANTUM)
            taken = self._serve(flow_id, flow, quantum, out)
            left -= taken
            size += taken
            if flow.queue:
                self._enter(flow_id, flow)
        if not self._ready:
            self._ready = None
        if not self._bulk:
            self._bulk = None
        if self._ready is None and self._bulk is None and self._last is not None:
            size += sum(len(h) + (len(b) if b is not None else 0) for h, b in self._last)
            out += self._last
            self._last = None
        self.pending_bytes -= size
        if not out:
            return []
        if not self.batched:
            return [head if body is None else head + body for head, body in out]
        return self._batch(out)

    def _serve(self, flow_id: int, flow: _Flow, quantum: int, out: list[_Out]) -> int:
        """Up to ``quantum`` bytes of one flow's queue into ``out``: whole frames, or the first part of a DATA
        frame that does not fit (at least ``MIN_PART`` bytes of it: a budget is a target, not a wall)."""
        taken = 0
        queue = flow.queue
        hsize = self._data_head
        while queue and taken < quantum:
            item = queue[0]
            payload = item[0]
            if isinstance(payload, memoryview):  # DATA: encoded now, split if it does not fit
                fin = bool(item[1])
                room = quantum - taken - hsize
                if len(payload) <= max(room, 0 if taken else self.MIN_PART):  # never an empty part left behind
                    queue.popleft()
                elif taken:
                    break  # the next turn
                else:
                    part = payload[:max(room, self.MIN_PART)]
                    queue[0] = (payload[len(part):], fin)
                    self.pending_bytes += hsize  # the rest needs a header of its own
                    flow.queued += hsize
                    payload, fin = part, False
                out.append((wire.data_header(flow_id, len(payload), fin, self.batched), payload))
                n = hsize + len(payload)
                flow.sent += len(payload)
            else:  # an encoded frame: END or RESET behind the data, a packet
                queue.popleft()
                body = item[1]
                assert not isinstance(body, bool)  # only DATA carries a flag
                out.append((payload, body))
                n = len(payload) + (len(body) if body is not None else 0)
                if flow_id == _DATAGRAMS:
                    flow.sent += n
            taken += n
            flow.queued -= n
        if not queue and flow.ended:
            del self._flows[flow_id]
        return taken

    def _batch(self, out: list[_Out]) -> list[bytes]:
        budget = self.BATCH_BUDGET
        messages: list[bytes] = []
        parts: list[bytes | memoryview] = []
        size = 0
        for head, body in out:
            n = len(head) + (0 if body is None else len(body))
            if parts and size + n > budget:
                messages.append(b"".join(parts))
                parts, size = [], 0
            parts.append(head)
            if body is not None:
                parts.append(body)
            size += n
        messages.append(parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts))
        return messages
