"""Incremental detokenization: token ids in, text deltas out, correct at every step.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens)
and for SentencePiece (a token's leading space depends on its neighbour). So each step
decodes a short window twice, ending before and after the new tokens, and emits the
difference, once it no longer ends in an incomplete character (U+FFFD):

    ids:  ... [prefix_offset ......... read_offset) [new tokens]
                 decoded: prefix_text               decoded with new: full_text
    delta = full_text[len(prefix_text):]

Stop strings: the text that could still become the start of a stop string is held back;
when a stop string appears, the text is cut before it and the request ends.
"""

from __future__ import annotations

from precast.runtime.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens that seed the window, so the first output token decodes in context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all decoded output text (stop string excluded once found)
        self._emitted = 0  # chars of self.text already returned
        self.stopped = False

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Feed new tokens; returns the text that is now safe to show."""
        if self.stopped:
            return ""
        for token in token_ids:
            self._ids.append(token)
            prefix_text = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
            full_text = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                self.text += full_text[len(prefix_text) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        if final and self._read_offset < len(self._ids):
            # The output ended inside a character: show what the bytes decode to.
            prefix_text = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
            full_text = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
            self.text += full_text[len(prefix_text) :]
            self._read_offset = len(self._ids)
        if self._stop:
            # A stop string can only start where it could not have been seen before.
            search_from = max(0, self._emitted - self._hold)
            hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        safe = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : safe]
        self._emitted = safe
        return delta
