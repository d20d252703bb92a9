"""KV-cache events: what the prefix cache stores and drops, in-process and published over ZMQ in vLLM's format."""

from __future__ import annotations

import time

import httpx
import msgspec
import zmq

from precast.runtime import LLM, SamplingParams
from tests.runtime.test_executor import wait_idle
from tests.runtime.test_server import free_port, start_server, stop_server

B = 32  # tokens per block of the test engines


def test_stored_blocks_chain_and_evictions_remove_them(smollm2_bf16_engine, smollm2_block_bytes):
    prompts = [[100 + i] + list(range(1000 + 200 * i, 1000 + 200 * i + 130)) for i in range(6)]
    # 16 blocks: the later prompts evict the earlier ones' cached blocks
    with LLM(smollm2_bf16_engine, kv_cache_memory=16 * smollm2_block_bytes, kv_events=True) as llm:
        for p in prompts:
            llm.generate(p, SamplingParams(max_tokens=1, temperature=0))
        wait_idle(llm)
        events, dropped = llm.take_kv_events()
        assert dropped == 0 and llm.take_kv_events() == ([], 0)
    stored = {h: (parent, tokens) for is_stored, h, parent, tokens in events if is_stored}
    removed = [h for is_stored, h, _, _ in events if not is_stored]
    assert len(stored) == 6 * 4  # 131 prompt tokens + 1: 4 full blocks each
    for p in prompts:  # each prompt's blocks: its tokens in order, each block's parent the one before
        chain = [h for h, (parent, tokens) in stored.items() if tokens == p[:B]]
        assert len(chain) == 1
        for k in range(1, 4):
            nxt = [h for h, (parent, tokens) in stored.items() if parent == chain[-1]]
            assert len(nxt) == 1 and stored[nxt[0]][1] == p[k * B : (k + 1) * B]
            chain.append(nxt[0])
        assert stored[chain[0]][0] is None
    assert removed and set(removed) <= set(stored)  # evictions drop blocks that were stored


def test_off_by_default(smollm2_llm):
    smollm2_llm.generate(list(range(100, 200)), SamplingParams(max_tokens=1))
    assert smollm2_llm.take_kv_events() == ([], 0)


def test_published_in_vllms_wire_format(smollm2_bf16_engine):
    port = free_port()
    proc, base = start_server(smollm2_bf16_engine, "--kv-events-endpoint", f"tcp://127.0.0.1:{port}")
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.5)  # the subscription reaches the publisher
        ids = list(range(300, 300 + 3 * B + 5))
        r = httpx.post(f"{base}/v1/completions", json={"model": "smol", "prompt": ids, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        sub.setsockopt(zmq.RCVTIMEO, 10_000)
        topic, sequence, payload = sub.recv_multipart()
        batch = msgspec.msgpack.decode(payload)  # untyped: the layout itself is checked
    finally:
        sub.close(linger=0)
        stop_server(proc)
    assert topic == b"" and int.from_bytes(sequence, "big") == 0
    ts, events = batch[0], batch[1]
    assert abs(ts - time.time()) < 60 and len(events) == 3
    parent = None
    for k, event in enumerate(events):
        tag, hashes, parent_hash, token_ids, block_size, lora_id, medium = event
        assert (tag, block_size, lora_id, medium) == ("BlockStored", B, None, "CPU")
        assert parent_hash == parent and token_ids == ids[k * B : (k + 1) * B] and len(hashes) == 1
        parent = hashes[0]
