"""Prefix affinity's choices (runtime/replicas/affinity.py) and what the ingress routes by (proxy.routing_text)."""

from __future__ import annotations

import json

from precast.runtime.replicas.affinity import AffinitySettings, PrefixIndex, chunk_keys
from precast.runtime.replicas.proxy import routing_text

SYSTEM = "You are a careful assistant. " * 10  # 290 characters: 4 chunks of 64


def test_chunk_keys_are_chained():
    a, b = chunk_keys(SYSTEM + "first question", 64), chunk_keys(SYSTEM + "another one", 64)
    assert len(a) == len(b) == 4 and a == b  # the questions fall in the partial last chunk
    c = chunk_keys("x" + SYSTEM[1:], 64)
    assert all(x != y for x, y in zip(a, c))  # a difference in the first chunk changes every later key
    assert chunk_keys("short", 64) == []


def test_choose_follows_the_longest_shared_prefix():
    index = PrefixIndex(AffinitySettings(chunk_chars=64))
    index.record("a", chunk_keys(SYSTEM[:128], 64))
    index.record("b", chunk_keys(SYSTEM, 64))
    keys = chunk_keys(SYSTEM + "question", 64)
    assert index.choose(keys, {"a": 0, "b": 0}) == "b"
    assert index.choose(chunk_keys("Something else entirely. " * 5, 64), {"a": 0, "b": 0}) is None
    assert index.choose([], {"a": 0, "b": 0}) is None


def test_too_busy_or_too_little_shared_falls_back():
    index = PrefixIndex(AffinitySettings(chunk_chars=64, min_match=0.5, max_imbalance=3))
    index.record("a", chunk_keys(SYSTEM, 64))
    keys = chunk_keys(SYSTEM, 64)
    assert index.choose(keys, {"a": 3, "b": 0}) == "a"
    assert index.choose(keys, {"a": 4, "b": 0}) is None  # 4 more ongoing requests than b
    long_prompt = chunk_keys(SYSTEM + "y" * 1000, 64)  # 4 of 20 chunks shared: under min_match
    assert index.choose(long_prompt, {"a": 0, "b": 0}) is None


def test_memory_is_bounded_and_forgotten_replicas_match_nothing():
    index = PrefixIndex(AffinitySettings(chunk_chars=8, max_chunks_per_replica=10))
    for i in range(20):
        index.record("a", chunk_keys(f"prompt {i:02d} " * 4, 8))
    assert len(index.seen["a"]) == 10
    assert index.choose(chunk_keys("prompt 19 " * 4, 8), {"a": 0}) == "a"  # the most recent survive
    assert index.choose(chunk_keys("prompt 00 " * 4, 8), {"a": 0}) is None
    index.forget("a")
    assert index.choose(chunk_keys("prompt 19 " * 4, 8), {"a": 0}) is None


def body(data) -> bytes:
    return json.dumps(data).encode()


def test_routing_text_from_openai_bodies():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]}]}
    assert routing_text(body(chat)) == "<system>S\n<user>Q"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert routing_text(body(chat | {"tools": tools})).startswith('[{"type":"function"')  # rendered before the messages
    assert routing_text(body({"prompt": "abc"})) == "abc"
    assert routing_text(body({"prompt": ["first", "second"]})) == "first"
    assert routing_text(body({"prompt": [1, 2, 3]})) == "1 2 3"
    assert routing_text(body({"prompt": [[1, 2], [3]]})) == "1 2"
    for bad in (b"not json", b"[1]", body({"prompt": {"x": 1}}), b""):
        assert routing_text(bad) == ""
