"""The engine's tokenizer: `tokenizers` for text <-> ids, Jinja for chat templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from precast.engine.directory import Engine
from precast.errors import PrecastError


class Tokenizer:
    def __init__(self, engine: Engine) -> None:
        info = engine.config.tokenizer
        if info is None or engine.tokenizer_path is None:
            raise PrecastError(f"engine {engine.path} has no tokenizer; pass token ids instead of text")
        self._tok = HFTokenizer.from_file(str(engine.tokenizer_path))
        self.bos_token_id: int | None = info.get("bos_token_id")
        self.eos_token_ids: list[int] = list(info.get("eos_token_ids") or [])
        self.chat_template: str | None = info.get("chat_template")
        self._max_token_chars: int | None = None
        self._special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        config = _read_tokenizer_config(engine.path)
        self.add_bos = bool(config.get("add_bos_token", False))
        self._template_tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long prompt tokenized in a
        # server's worker thread does not stall its event loop.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token's vocabulary entry has: with the bound in LLM.prompt_ids, text far
        too long for the engine is refused before the tokenizer spends seconds on it."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text; `tools` (OpenAI function tools) are rendered by the template, as HF does."""
        if not self.chat_template:
            raise PrecastError("this engine's tokenizer has no chat template; send plain prompts instead")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
                raise PrecastError("each chat message needs a 'role' and a 'content'")
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None, **self._template_tokens
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # HF writes AddedToken objects as dicts
        return value.get("content")
    return value


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    file = path / "tokenizer_config.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str) -> Any:
    """Chat templates run in Jinja's sandbox with the helpers HF templates expect."""
    if source not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        # HF's tojson: plain JSON (Jinja's own escapes <, > and & for HTML, which models never saw in training)
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
