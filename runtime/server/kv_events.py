"""KV-cache events for KV-aware routers (llm-d, Dynamo): what the prefix cache stores and drops, published over ZMQ.

The wire format is vLLM's, so routers that consume vLLM's events read precast's unchanged: a PUB socket sends
multipart messages [topic, sequence number (8 bytes, big-endian), payload], the payload a msgpack array
[timestamp, [event, ...]] where an event is ["BlockStored", [hash], parent hash or nil, token ids, block size,
lora id (nil), medium] or ["BlockRemoved", [hash], medium] (msgspec tagged, array-like structs). Hashes are precast's
64-bit chain hashes of (parent hash, the block's token ids). A batch is sent every `interval` seconds when something
changed. If more than the executor keeps piled up between two batches, the oldest are lost: an AllBlocksCleared event
then tells routers to forget this replica's blocks (the stores that follow rebuild what it holds).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec

from precast.errors import PrecastError

MEDIUM = "CPU"  # where precast's KV blocks live


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change in the cache; tagged with its class name on the wire."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KvEventPublisher:
    """A thread that takes the LLM's prefix-cache events and publishes them on `endpoint` (a ZMQ address to bind,
    e.g. tcp://*:5557) under `topic`."""

    def __init__(self, llm: Any, endpoint: str, topic: str = "", interval: float = 0.05):
        try:
            import zmq
        except ImportError as e:
            raise PrecastError("KV events need pyzmq: pip install pyzmq") from e
        self.llm, self.topic, self.interval = llm, topic.encode(), interval
        self.block_size = llm.engine.config.limits.tokens_per_block
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError as e:
            self.socket.close(linger=0)
            raise PrecastError(f"cannot publish KV events on {endpoint}: {e}") from e
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the bound address (a `*` port resolved)
        self.encoder = msgspec.msgpack.Encoder()
        self.sequence = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="precast-kv-events", daemon=True)
        self.thread.start()

    def batch(self) -> EventBatch | None:
        """The events since the last batch, or None when nothing changed."""
        raw, dropped = self.llm.take_kv_events()
        events: list[Any] = [AllBlocksCleared()] if dropped else []
        for stored, block_hash, parent, tokens in raw:
            if stored:
                events.append(BlockStored([block_hash], parent, list(tokens), self.block_size, None, MEDIUM))
            else:
                events.append(BlockRemoved([block_hash], MEDIUM))
        return EventBatch(time.time(), events) if events else None

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            self.publish()
        self.publish()  # what the last interval left

    def publish(self) -> None:
        batch = self.batch()
        if batch is None:
            return
        self.socket.send_multipart([self.topic, self.sequence.to_bytes(8, "big"), self.encoder.encode(batch)])
        self.sequence += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.socket.close(linger=500)
