"""precast's Ray Serve request router for the replica deployment: prefix affinity (affinity.py) falling back to the
least loaded replica, or plain round robin (the baseline the affinity is measured against).

Ray Serve calls `choose_replicas` with the pending request's arguments: the ingress passes a ProxiedRequest whose
`routing_text` is the prompt, so this router sees prompts even though Ray's HTTP proxy never parses bodies. It returns
ranks of replicas; Ray takes the least loaded replica of the first rank that has room (`max_ongoing_requests`) and
falls through to the next rank otherwise.

Ray ships this class to the ingress pickled by value (even when named by import path), so module-level state here would
be a private copy: the decision counts live in affinity.py, which is imported by reference.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from precast.runtime.replicas import ROUTINGS, affinity
from precast.runtime.replicas.affinity import AffinitySettings, PrefixIndex, chunk_keys

ROUTING_MODES = tuple(r for r in ROUTINGS if r != "least_loaded")  # the rest are this router's


class PrecastRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, mode: str = "prefix", **settings: Any) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"unknown routing mode {mode!r}; one of {', '.join(ROUTING_MODES)}")
        self.mode = mode
        self.index = PrefixIndex(AffinitySettings(**settings))
        self.turn = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if self.mode == "round_robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            self.turn += 1
            affinity.DECISIONS["round_robin"] += 1
            return [[ordered[self.turn % len(ordered)]]]
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {rid: self.replica_queue_len_cache.get(rid) or 0 for rid in by_id}
        text = getattr(pending_request.args[0], "routing_text", "") if pending_request and pending_request.args else ""
        keys = chunk_keys(text or "", self.index.settings.chunk_chars)
        chosen = self.index.choose(keys, loads)
        if chosen is None:  # the least loaded; ties broken at random so new prefixes spread
            fewest = min(loads.values())
            chosen = random.choice([rid for rid, load in loads.items() if load == fewest])
            affinity.DECISIONS["least_loaded" if keys else "no_prompt"] += 1
        else:
            affinity.DECISIONS["affinity"] += 1
        # Recorded now: Ray reports where a request went only under its strict max_ongoing_requests mode. The first
        # rank is taken unless that replica is full, when Ray falls through to the others.
        self.index.record(chosen, keys)
        return [[by_id[chosen]], [r for r in candidate_replicas if r.replica_id != chosen]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)
