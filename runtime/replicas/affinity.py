"""Prefix affinity: send a request to the replica that already served its prompt's beginning (so that replica's
prefix cache holds it), unless that replica is much busier than the least busy one.

Pure Python, no Ray: router.py wraps it in Ray Serve's RequestRouter. The router runs where the handle is used (the
ingress), so it never sees the replicas' caches; it remembers what it sent where. Prompts are compared as text, in
chunks of `chunk_chars` characters, each chunk's key chained to the one before (like the KV cache's block hashes), so
two prompts share a key exactly when they share everything up to the end of that chunk.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

# Routing decisions taken in this process (the ingress), by kind; the ingress's /metrics exports them.
DECISIONS: Counter[str] = Counter()


@dataclass(frozen=True)
class AffinitySettings:
    chunk_chars: int = 64  # granularity of a match; a shorter prompt is never matched
    min_match: float = 0.1  # fraction of the prompt's chunks that must match for affinity to count
    max_imbalance: int = 8  # affinity only while the chosen replica has at most this many more ongoing requests
    max_chunks_per_replica: int = 1 << 16  # what is remembered per replica (least recently used forgotten first)


def chunk_keys(text: str, chunk_chars: int) -> list[int]:
    """One chained key per full chunk of `text`."""
    keys, previous = [], 0
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        previous = hash((previous, text[start : start + chunk_chars]))
        keys.append(previous)
    return keys


class PrefixIndex:
    """Which prompt prefixes were sent to which replica."""

    def __init__(self, settings: AffinitySettings | None = None):
        self.settings = settings or AffinitySettings()
        self.seen: dict[Hashable, OrderedDict[int, None]] = {}

    def matched_chunks(self, replica: Hashable, keys: list[int]) -> int:
        seen = self.seen.get(replica)
        if not seen:
            return 0
        count = 0
        for key in keys:  # chained keys: the first miss ends the shared prefix
            if key not in seen:
                break
            count += 1
        return count

    def record(self, replica: Hashable, keys: list[int]) -> None:
        seen = self.seen.setdefault(replica, OrderedDict())
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.settings.max_chunks_per_replica:
            seen.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        self.seen.pop(replica, None)

    def choose(self, keys: list[int], loads: dict[Hashable, int]) -> Hashable | None:
        """The replica holding the longest prefix of the prompt, or None when no replica holds enough of it or the
        best one is too busy (the caller then picks the least loaded). `loads`: ongoing requests per candidate."""
        if not keys or not loads:
            return None
        matches = {replica: self.matched_chunks(replica, keys) for replica in loads}
        best = max(loads, key=lambda r: (matches[r], -loads[r]))
        if matches[best] == 0 or matches[best] < self.settings.min_match * len(keys):
            return None
        if loads[best] - min(loads.values()) > self.settings.max_imbalance:
            return None
        return best
