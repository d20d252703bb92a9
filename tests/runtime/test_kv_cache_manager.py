"""KV cache manager invariants under random operation sequences (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from precast import _C

B = 4  # tokens per block


def test_prefix_reuse_counts_and_lru():
    kv = _C.KvCacheManager(8, B)
    tokens = list(range(13))  # 3 full blocks + 1 token
    assert kv.match_prefix(1, tokens) == 0
    assert kv.allocate(1, 13)
    kv.commit(1, tokens, 13)
    kv.free(1)
    s = kv.stats()
    assert s.cached_blocks == 3 and s.used_blocks == 0 and s.free_blocks == 8
    # Same prompt: 3 blocks reused (the last token is always recomputed).
    assert kv.match_prefix(2, tokens) == 12
    assert kv.block_table(2)[:3] == [0, 1, 2]
    assert kv.stats().reused_blocks == 0  # matching counts nothing: the scheduler counts at admission
    kv.count_prefix_lookup(len(tokens), 12)
    assert kv.stats().reused_blocks == 3
    # A prompt sharing only the first block.
    other = tokens[:4] + [99] * 9
    assert kv.match_prefix(3, other) == 4
    kv.check_integrity()
    kv.free(2)
    kv.free(3)
    # Filling the pool evicts cached blocks, least recently used first.
    assert kv.allocate(4, 8 * B)
    assert kv.stats().cached_blocks == 0 and kv.num_allocatable_blocks() == 0
    assert not kv.allocate(5, 1)  # all or nothing
    kv.check_integrity()


def test_truncate_returns_rejected_draft_blocks():
    """Speculative decoding: blocks allocated for proposed tokens that were rejected go back to the pool; the
    registered blocks before them stay in the table and in the prefix cache."""
    kv = _C.KvCacheManager(8, B)
    tokens = list(range(9))
    kv.match_prefix(1, tokens)
    assert kv.allocate(1, 9 + 8)  # 9 tokens + 8 proposed: 5 blocks
    assert len(kv.block_table(1)) == 5
    kv.commit(1, tokens + [50], 10)  # one proposal accepted: 10 computed, 2 full blocks registered
    kv.truncate(1, 11)  # 10 accepted + the bonus token: 3 blocks
    assert len(kv.block_table(1)) == 3
    s = kv.stats()
    assert s.used_blocks == 3 and s.free_blocks == 5 and s.cached_blocks == 2
    kv.truncate(1, 11)  # idempotent
    kv.check_integrity()
    kv.free(1)
    assert kv.match_prefix(2, tokens + [50]) == 8  # the registered prefix is still found
    kv.check_integrity()


def test_match_needs_exact_tokens_and_chain():
    kv = _C.KvCacheManager(8, B)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    kv.match_prefix(1, a)
    kv.allocate(1, 9)
    kv.commit(1, a, 9)
    # Same second block, different first block: nothing matches (the chain differs).
    b = [9, 9, 9, 9, 5, 6, 7, 8, 9]
    assert kv.match_prefix(2, b) == 0
    kv.check_integrity()


ops = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5), st.integers(1, 30), st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, prefix_reuse=st.booleans())
def test_random_operations_keep_accounting_exact(ops, prefix_reuse):
    kv = _C.KvCacheManager(12, B, prefix_reuse)
    live: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    next_id = 1
    for op, which, n, vocab in ops:
        if op == "add":
            tokens = [(i * (vocab + 1)) % 3 for i in range(n)]  # few distinct prompts: many shared prefixes
            cached = kv.match_prefix(next_id, tokens)
            assert cached % B == 0 and cached < len(tokens)
            if kv.allocate(next_id, len(tokens)):
                live[next_id] = tokens
                computed[next_id] = len(tokens)
                kv.commit(next_id, tokens, len(tokens))
                assert len(kv.block_table(next_id)) == -(-len(tokens) // B)
            else:
                kv.free(next_id)
            next_id += 1
        elif op == "grow" and live:
            rid = sorted(live)[which % len(live)]
            extra = [7] * (n % 5 + 1)
            if kv.allocate(rid, len(live[rid]) + len(extra)):
                live[rid] += extra
                kv.commit(rid, live[rid], len(live[rid]))
        elif op == "free" and live:
            rid = sorted(live)[which % len(live)]
            kv.free(rid)
            del live[rid]
        kv.check_integrity()
        s = kv.stats()
        assert s.free_blocks + s.used_blocks == s.max_blocks == 12
        distinct = {b for rid in live for b in kv.block_table(rid)}
        assert s.used_blocks == len(distinct)
        if not prefix_reuse:
            assert s.cached_blocks == 0 and s.reused_blocks == 0
    for rid in list(live):
        kv.free(rid)
    kv.check_integrity()
    assert kv.stats().used_blocks == 0
