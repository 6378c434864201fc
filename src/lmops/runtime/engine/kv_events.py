"""KV-cache events in vLLM's wire format, for llm-d's precise prefix-cache scorer.

The block manager records what its prefix cache gains and loses (`BlockStored`: a run
of newly cached full blocks, their hashes chained through the parent's, with their
token ids; `BlockRemoved`: evicted hashes; `AllBlocksCleared`: a new or reset cache),
and the engine publishes each step's events as one `EventBatch`, as vLLM does:

- a ZMQ PUB socket sends multipart `[topic, seq, payload]`, `seq` an 8-byte big-endian
  counter from 0 and `payload` the msgpack of the batch (msgspec: the batch a positional
  array `[ts, events, data_parallel_rank]`, each event a map tagged by its "type", as
  vLLM encodes them since it dropped `array_like` from its event structs; llm-d's
  decoder reads both layouts);
- an optional ROUTER socket answers `[identity, b"", start_seq]` with every buffered
  batch from `start_seq` on, `[identity, b"", topic, seq, payload]` each, then `seq` -1
  and an empty payload, so a subscriber that saw a gap in `seq` (or has just connected:
  a PUB socket drops what it sends before a new subscription reaches it) can catch up.
  The frames are those llm-d's replay reader (a DEALER socket) takes.

The PUB socket is used under a lock (a service swapping versions has two engines
publishing through it for a moment); a thread of this module owns the ROUTER socket and
reads the replay buffer under the same lock.
Sockets bind at construction, so a bad endpoint fails the engine's start, not a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from lmops.errors import LmopsError
from lmops.runtime.engine.config import KVEventsConfig

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache tier, whatever the device


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's tagged event: a map of its fields and "type", the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


def external_hash(block_hash: bytes) -> int:
    """A block's key on the wire: its hash's last 8 bytes as an unsigned integer, as vLLM
    sends its own (and as llm-d reads a bytes hash)."""
    return int.from_bytes(block_hash[-8:], "big")


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, IPv6 or local endpoint is bound; any other is connected to
    (a subscriber that binds, e.g. llm-d's central indexer)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket for each step's batch, ROUTER socket for replays of the last
    `buffer_steps` batches."""

    def __init__(self, config: KVEventsConfig, context: zmq.Context | None = None):
        self.topic = config.topic.encode()
        self._ctx = context or zmq.Context.instance()
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._thread = None
        self._stop = threading.Event()
        try:
            _open(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                _open(self._replay, config.replay_endpoint, bind=True)
        except LmopsError:
            self.close()
            raise
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve_replays, name="lmops-kv-events", daemon=True)
            self._thread.start()
        log.info(
            "KV-cache events: %s %s (topic %r), replay %s",
            "bound to" if binds(config.endpoint) else "connected to",
            config.endpoint,
            config.topic,
            config.replay_endpoint or "off",
        )

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send one batch and keep it for replay; from any thread (during a swap two engines
        share the sockets), one at a time."""
        payload = self._encoder.encode(EventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            # A PUB socket never blocks: past a subscriber's hwm it drops (replay still has it).
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self._replay.poll(100):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("KV-cache events: a replay request of %d frames, not 3, ignored", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big", signed=True)
            with self._lock:
                batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
            for seq, payload in batches:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", self.topic, END_SEQ, b""))

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(5)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()


def _open(socket: zmq.Socket, endpoint: str, bind: bool | None = None) -> None:
    """Bind or connect (vLLM's rule unless `bind` says); a failure is one line naming the endpoint."""
    bind = binds(endpoint) if bind is None else bind
    try:
        socket.bind(endpoint) if bind else socket.connect(endpoint)
    except zmq.ZMQError as exc:
        raise LmopsError(
            f"KV-cache events: cannot {'bind' if bind else 'connect to'} {endpoint}: {exc}"
        ) from None


def make_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher a config asks for; None when events are off (or `publisher` is "null")."""
    return ZmqEventPublisher(config) if config is not None and config.publishes else None
