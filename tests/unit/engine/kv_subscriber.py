"""A KV-cache event subscriber written from vLLM's documented types (vllm/distributed/
kv_events.py: the batch positional, the events maps tagged by "type") and llm-d's replay
protocol, not from lmops' code: what an llm-d indexer decodes. SUB socket bound here
(the engine connects: llm-d's central mode) or connected to the engine's bound endpoint;
on a gap in the sequence numbers, or a quiet spell (a PUB socket drops what it sends
before a new subscription reaches it, so the first batches are usually missed), it asks
the replay socket (DEALER, as llm-d: a REQ socket takes one reply only) for the missing
batches, `[b"", topic, seq, payload]` each, ending with seq -1 and an empty payload."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", bind: bool = True):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.bind(endpoint) if bind else self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.topic = topic.encode()
        self.replay_endpoint, self.replay = replay_endpoint, None  # connected at the first replay
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: dict[int, KVEventBatch] = {}  # seq -> batch
        self.replayed: list[int] = []
        self.topics: set[bytes] = set()
        self.drop_next = False  # a deliberate gap: discard the next batch received live

    @property
    def last_seq(self) -> int:
        """The end of the contiguous run of batches from seq 0."""
        seq = -1
        while seq + 1 in self.batches:
            seq += 1
        return seq

    def events(self) -> list:
        """Every event, in sequence order (contiguous only)."""
        return [e for seq in range(self.last_seq + 1) for e in self.batches[seq].events]

    def poll(self, until, timeout: float = 20.0) -> None:
        """Receive (and replay what was missed) until `until(self)` holds."""
        deadline = time.monotonic() + timeout
        while not until(self):
            assert time.monotonic() < deadline, f"timed out with batches {sorted(self.batches)}"
            if not self.sub.poll(200):  # quiet: catch up on what may have been missed
                self._replay_from(self.last_seq + 1)
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            seq = int.from_bytes(seq_bytes, "big")
            if self.drop_next:
                self.drop_next = False
                continue
            if seq > self.last_seq + 1:
                self._replay_from(self.last_seq + 1)
            self.batches[seq] = self.decoder.decode(payload)

    def _replay_from(self, start: int) -> None:
        if self.replay is None:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(self.replay_endpoint)
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert self.replay.poll(5000), "no answer from the replay socket"
            empty, topic, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b"" and topic.startswith(self.topic)
            self.topics.add(topic)
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                return
            seq = int.from_bytes(seq_bytes, "big")
            self.replayed.append(seq)
            self.batches[seq] = self.decoder.decode(payload)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
