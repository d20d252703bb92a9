"""SamplingParams: how one request is decoded (validated here, executed by the C++ sampler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from precast.errors import PrecastError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings; never part of the output text
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)  # words never generated
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: chosen token's; n: also the n most likely
    skip_special_tokens: bool = True
    priority: int = 0

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise PrecastError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            bad(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be between 0 and max_tokens, got {self.min_tokens!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            bad("bad_words must be non-empty strings")
