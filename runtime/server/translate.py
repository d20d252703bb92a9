"""Request translation: OpenAI bodies -> (prompt ids, SamplingParams) jobs, outputs -> OpenAI response parts.

Every check that turns a bad request into a 400 lives here, before anything is enqueued.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from precast.errors import PrecastError
from precast.runtime.llm import LLM, RequestOutput
from precast.runtime.sampling_params import SamplingParams, engine_defaults
from precast.runtime.server.protocol import DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest

Job = tuple[list[int], SamplingParams]  # one choice: its prompt ids and how it is sampled


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


MAX_CHOICES = 2048  # prompts x n in one request: each is a request in the executor


class Translator:
    def __init__(self, llm: LLM, model_name: str):
        self.llm, self.model_name = llm, model_name
        self.defaults = engine_defaults(llm.engine.config.generation)  # for fields a body leaves out

    # ---- requests -> jobs ------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise OpenAIError(
                404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.", param="model", code="model_not_found"
            )

    def precheck(self, data: dict[str, Any]) -> None:
        """Bounds a raw body must meet before it is validated: validating a 4 MiB list of token ids holds
        the GIL for a quarter second (pydantic), which would stall the event loop's thread too."""
        limit = self.llm.max_seq_len
        prompt, messages = data.get("prompt"), data.get("messages")
        if isinstance(prompt, list) and prompt:
            prompts = [prompt] if isinstance(prompt[0], int) else prompt  # one prompt of ids, or a batch
            for p in prompts:
                if isinstance(p, list) and len(p) > limit:
                    self.check_length(p, 0, "prompt")  # raises: longer than the context
            n = data.get("n", 1) if isinstance(data.get("n", 1), int) else 1
            if len(prompts) * n > MAX_CHOICES:
                raise OpenAIError(
                    400, f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices in one request; split it", param="prompt"
                )
        if isinstance(messages, list) and len(messages) > limit:  # each message takes at least one token
            raise OpenAIError(400, f"{len(messages)} messages cannot fit this model's context of {limit} tokens", param="messages")

    def check_length(self, prompt_ids: list[int], max_tokens: int, param: str) -> None:
        limit = self.llm.max_seq_len
        if not prompt_ids:
            raise OpenAIError(400, "the prompt is empty", param=param)
        if len(prompt_ids) + max_tokens > limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.",
                param=param,
                code="context_length_exceeded",
            )

    @staticmethod
    def check_params(jobs: list[Job]) -> None:
        for _, params in jobs:
            try:
                params.validate()
            except PrecastError as e:
                raise OpenAIError(400, str(e)) from e

    def completion_jobs(self, body: CompletionRequest) -> list[Job]:
        if body.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        raw = body.prompt
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        try:
            prompts = [self.llm.prompt_ids(p) for p in raw]
        except PrecastError as e:
            raise OpenAIError(400, str(e), param="prompt") from e
        max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
        for p in prompts:
            self.check_length(p, max_tokens, "prompt")
        jobs = [(p, body.sampling(max_tokens, body.logprobs, i, self.defaults)) for p in prompts for i in range(body.n)]
        self.check_params(jobs)
        return jobs

    def chat_jobs(self, body: ChatCompletionRequest) -> list[Job]:
        try:
            prompt = self.llm.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        except PrecastError as e:
            raise OpenAIError(400, str(e), param="messages") from e
        except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
            raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from e
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, self.llm.max_seq_len - len(prompt))
        self.check_length(prompt, max_tokens, "messages")
        top = body.top_logprobs if body.top_logprobs is not None else (0 if body.logprobs else None)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        jobs = [(prompt, body.sampling(max_tokens, top, i, self.defaults)) for i in range(body.n)]
        self.check_params(jobs)
        return jobs

    # ---- outputs -> response parts ---------------------------------------------------
    @staticmethod
    def usage(outs: list[RequestOutput], jobs: list[Job]) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p, _ in jobs)
        completion = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

    @staticmethod
    def finish_reason(out: RequestOutput) -> str | None:
        return None if out.finish_reason is None else ("length" if out.finish_reason == "length" else "stop")

    def token_text(self, token: int) -> str:
        return self.llm.tokenizer.decode([token], skip_special_tokens=False) if self.llm.tokenizer else str(token)

    def completion_logprobs(self, out: RequestOutput, start: int = 0) -> dict[str, Any]:
        tokens = [self.token_text(t) for t in out.token_ids[start:]]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": out.logprobs[start:],
            "top_logprobs": [{self.token_text(t): lp for t, lp in top} for top in out.top_logprobs[start:]],
            "text_offset": offsets,
        }

    def chat_logprobs(self, out: RequestOutput, start: int = 0) -> dict[str, Any]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            text = self.token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                entry(t, lp) | {"top_logprobs": [entry(tt, tlp) for tt, tlp in top]}
                for t, lp, top in zip(out.token_ids[start:], out.logprobs[start:], out.top_logprobs[start:])
            ]
        }

    def completion_choice(self, body: CompletionRequest, i: int, out: RequestOutput, start: int, streaming: bool) -> dict[str, Any]:
        lp = self.completion_logprobs(out, start) if body.logprobs is not None else None
        return {"index": i, "text": out.delta if streaming else out.text, "logprobs": lp, "finish_reason": self.finish_reason(out)}

    def chat_choice(self, body: ChatCompletionRequest, i: int, out: RequestOutput, start: int, streaming: bool) -> dict[str, Any]:
        lp = self.chat_logprobs(out, start) if body.logprobs else None
        if streaming:
            delta = {"content": out.delta} if out.delta else {}
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": self.finish_reason(out)}
        message = {"role": "assistant", "content": out.text}
        return {"index": i, "message": message, "finish_reason": self.finish_reason(out), "logprobs": lp}
