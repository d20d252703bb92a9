"""Scheduler invariants under random request streams (hypothesis), through the bound C++ Scheduler.

Each step: requests may arrive (random priority), one may be cancelled, the scheduler plans a step, and
`advance` applies it as the executor would (tokens computed, one sampled token per sampling request).
Checked after every step: the token budget and batch size, a request in exactly one of running / waiting,
waiting in policy order (priority, then arrival), admission from the head of that order, preemption of
the newest running requests only, and the KV manager's own integrity check.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from precast import _C

B = 4  # tokens per block

step_ops = st.tuples(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)), max_size=3),  # (prompt len, max_tokens, priority)
    st.booleans(),  # cancel the oldest running request
)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(step_ops, min_size=1, max_size=40),
    num_blocks=st.integers(16, 40),
    max_batch=st.integers(1, 6),
    budget=st.integers(6, 48),
    chunked=st.booleans(),
    prefix_reuse=st.booleans(),
)
def test_scheduler_invariants(steps, num_blocks, max_batch, budget, chunked, prefix_reuse):
    sched = _C.Scheduler(num_blocks, B, max_batch, budget, chunked, prefix_reuse)
    order: dict[int, tuple[int, int]] = {}  # id -> (priority, arrival)
    limit: dict[int, int] = {}  # id -> prompt + max_tokens
    done: set[int] = set()
    next_id = 1
    for arrivals, cancel in steps:
        for length, max_tokens, priority in arrivals:
            if not chunked and length > budget:
                continue  # the executor refuses such a request before it reaches the scheduler
            if (length + max_tokens + B - 1) // B > num_blocks:
                continue  # likewise: more KV than the whole cache
            prompt = [(next_id * 7 + i) % 5 for i in range(length)]  # few distinct tokens: prefixes repeat
            sched.add(next_id, prompt, max_tokens, priority)
            order[next_id] = (-priority, len(order))
            limit[next_id] = length + max_tokens
            next_id += 1
        running_before = sched.running()
        if cancel and running_before:
            assert sched.remove(running_before[0])
            done.add(running_before[0])
            running_before = running_before[1:]
        waiting_before = sched.waiting()
        preemptions = sched.num_preemptions

        plan = sched.schedule()
        running, waiting = sched.running(), sched.waiting()

        assert sum(n for _, n, _ in plan) <= budget
        assert len(plan) <= max_batch and len(running) <= max_batch
        assert not set(running) & set(waiting)
        assert set(running) | set(waiting) == set(order) - done
        assert waiting == sorted(waiting, key=order.get)  # policy order: priority, then arrival
        # Preemption takes the newest running requests: the older ones keep running, in order.
        num_preempted = sched.num_preemptions - preemptions
        kept = running_before[: len(running_before) - num_preempted]
        assert running[: len(kept)] == kept
        # Then admission takes the head of the waiting queue (preempted requests rejoin it by policy), in order.
        queue = sorted(waiting_before + running_before[len(kept) :], key=order.get)
        admitted = running[len(kept) :]
        assert admitted == queue[: len(admitted)]
        sched.check_integrity()

        sched.advance(plan, 1)
        for rid, _, sample in plan:  # a request that reached its length finishes and leaves
            if sample and sched.num_tokens(rid) >= limit[rid]:
                assert sched.remove(rid)
                done.add(rid)
        sched.check_integrity()
