"""Response translation: request outputs -> OpenAI response parts (choices, logprobs, usage, tool calls).

The request side, and the errors every 400 uses, are translate.py's.
"""

from __future__ import annotations

from typing import Any

from precast.runtime.llm import LLM, RequestOutput
from precast.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from precast.runtime.server.tools import ToolFormat
from precast.runtime.server.translate import Job


class Responses:
    def __init__(self, llm: LLM):
        self.llm = llm

    @staticmethod
    def usage(outs: list[RequestOutput], jobs: list[Job], generated: bool = True) -> dict[str, Any]:
        """`generated` false: the outputs' tokens are not shown (echo with max_tokens 0) and not counted."""
        prompt_tokens = sum(len(p) for p, _ in jobs)
        completion = sum(len(o.token_ids) for o in outs) if generated else 0
        cached = sum(o.num_cached_tokens for o in outs)  # prompt tokens served from the prefix cache
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    @staticmethod
    def finish_reason(out: RequestOutput) -> str | None:
        return None if out.finish_reason is None else ("length" if out.finish_reason == "length" else "stop")

    def token_text(self, token: int) -> str:
        return self.llm.tokenizer.decode([token], skip_special_tokens=False) if self.llm.tokenizer else str(token)

    @staticmethod
    def content_tokens(out: RequestOutput) -> int:
        """How many of the output's tokens make its text: the eos or stop token that ended it does not."""
        return len(out.token_ids) - int(out.ends_with_stop_token)

    def completion_logprobs(self, out: RequestOutput, start: int = 0) -> dict[str, Any]:
        end = self.content_tokens(out)
        tokens = [self.token_text(t) for t in out.token_ids[start:end]]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": out.logprobs[start:end],
            "top_logprobs": [{self.token_text(t): lp for t, lp in top} for top in out.top_logprobs[start:end]],
            "text_offset": offsets,
        }

    def chat_logprobs(self, out: RequestOutput, start: int = 0) -> dict[str, Any]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            text = self.token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        end = self.content_tokens(out)
        return {
            "content": [
                entry(t, lp) | {"top_logprobs": [entry(tt, tlp) for tt, tlp in top]}
                for t, lp, top in zip(out.token_ids[start:end], out.logprobs[start:end], out.top_logprobs[start:end])
            ]
        }

    def completion_choice(self, body: CompletionRequest, i: int, out: RequestOutput, start: int, streaming: bool) -> dict[str, Any]:
        if body.echo:
            return self.echo_choice(body, i, out, start, streaming)
        lp = self.completion_logprobs(out, start) if body.logprobs is not None else None
        return {"index": i, "text": out.delta if streaming else out.text, "logprobs": lp, "finish_reason": self.finish_reason(out)}

    def echo_choice(self, body: CompletionRequest, i: int, out: RequestOutput, start: int, streaming: bool) -> dict[str, Any]:
        """The prompt (in the first chunk when streaming), then the completion (none with max_tokens 0); with
        logprobs the prompt's tokens are scored too, the first with null (nothing predicts it), as OpenAI's echo
        does. Every generated token is listed, an ending eos too: lm-evaluation-harness drops the last entry as the
        generated one. `start`: output tokens already sent."""
        shown = 0 if body.max_tokens == 0 else len(out.token_ids)
        first = start == 0
        prompt_ids = out.prompt_token_ids if first else []
        prompt_text = self.llm.tokenizer.decode(prompt_ids, skip_special_tokens=False) if self.llm.tokenizer and prompt_ids else ""
        text = prompt_text + ((out.delta if streaming else out.text) if shown else "")  # the text leaves an ending eos out
        finish = ("length" if out.finished else None) if body.max_tokens == 0 else self.finish_reason(out)
        if body.logprobs is None:
            return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        token_ids = prompt_ids + out.token_ids[start:shown]
        logprobs = (out.prompt_logprobs if first else []) + out.logprobs[start:shown]
        tops = (out.prompt_top_logprobs if first else []) + out.top_logprobs[start:shown]
        tokens = [self.token_text(t) for t in token_ids]
        offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        return {
            "index": i,
            "text": text,
            "logprobs": {
                "tokens": tokens,
                "token_logprobs": logprobs,
                "top_logprobs": [None if top is None else {self.token_text(t): lp for t, lp in top} for top in tops],
                "text_offset": offsets,
            },
            "finish_reason": finish,
        }

    def chat_choice(
        self, body: ChatCompletionRequest, i: int, out: RequestOutput, start: int, streaming: bool, calls: ToolCalls | None = None
    ) -> dict[str, Any]:
        """One choice of a chat response or chunk; `calls` (when tools may be called) turns tool-call text
        into `tool_calls`, holding streamed text back from where a call may begin."""
        lp = self.chat_logprobs(out, start) if body.logprobs else None
        content, tool_calls = calls.update(out) if calls else (out.delta if streaming else out.text, [])
        finish = "tool_calls" if tool_calls and out.finish_reason == "stop" else self.finish_reason(out)
        if streaming:
            delta: dict[str, Any] = {"content": content} if content else {}
            if tool_calls:
                delta["tool_calls"] = [c | {"index": k} for k, c in enumerate(tool_calls)]
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": i, "message": message, "finish_reason": finish, "logprobs": lp}


class ToolCalls:
    """One choice's tool calls. Streaming, text goes out as content until it may be a call; from there it
    is held back and parsed when the choice ends (calls, or the held text as content if it is none)."""

    def __init__(self, fmt: ToolFormat, streaming: bool):
        self.fmt, self.streaming, self.sent = fmt, streaming, 0

    def update(self, out: RequestOutput) -> tuple[str | None, list[dict[str, Any]]]:
        """(content to send now, tool calls) for this output."""
        if not out.finished:
            if self.fmt.starts_call(out.text):
                return None, []
            content, self.sent = out.text[self.sent :], len(out.text)
            return content, []
        content, calls = self.fmt.parse(out.text)
        if not self.streaming:
            return content, calls
        return (None if calls else out.text[self.sent :]), calls
