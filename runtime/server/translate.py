"""Request translation: OpenAI bodies -> (prompt ids, SamplingParams) jobs (responses.py builds the replies).

Every check that turns a bad request into a 400 lives here, before anything is enqueued: bounds, lengths, output
formats (compiled here, in the request's worker thread) and tool choices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi.responses import JSONResponse

from precast.errors import PrecastError
from precast.runtime.llm import LLM
from precast.runtime.sampling_params import SamplingParams, engine_defaults
from precast.runtime.server.protocol import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from precast.runtime.server.tools import ToolFormat, detect_format, template_messages

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

    def check_params(self, jobs: list[Job]) -> None:
        """Bounds, and output formats compiled here (a worker thread): a grammar takes milliseconds to seconds to
        compile, and the event loop must not wait for it when the request is submitted."""
        for _, params in jobs:
            try:
                params.validate()
                self.llm.prepare_output_format(params)
            except PrecastError as e:
                raise OpenAIError(400, str(e)) from e

    def completion_jobs(self, body: CompletionRequest) -> list[Job]:
        if body.max_tokens == 0 and not body.echo:
            raise OpenAIError(400, "max_tokens must be at least 1 (0 only with echo, to score the prompt)", param="max_tokens")
        raw = body.prompt
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        try:
            prompts = [self.llm.prompt_ids(p) for p in raw]
        except PrecastError as e:
            raise OpenAIError(400, str(e), param="prompt") from e
        # echo with max_tokens 0 generates one token that the response leaves out
        max_tokens = 1 if body.max_tokens == 0 else (body.max_tokens or DEFAULT_MAX_TOKENS)
        for p in prompts:
            self.check_length(p, max_tokens, "prompt")
        jobs = [(p, self.sampling(body, max_tokens, body.logprobs, i)) for p in prompts for i in range(body.n)]
        if body.echo and body.logprobs is not None:  # the prompt's tokens are scored too
            jobs = [(p, dataclasses.replace(params, prompt_logprobs=body.logprobs)) for p, params in jobs]
        self.check_params(jobs)
        return jobs

    def sampling(
        self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None, index: int
    ) -> SamplingParams:
        try:
            return body.sampling(max_tokens, logprobs, index, self.defaults)
        except ValueError as e:  # logit_bias keys, conflicting output formats
            raise OpenAIError(400, str(e)) from e

    def tool_format(self, body: ChatCompletionRequest) -> ToolFormat | None:
        """The format this request's tool calls are written and parsed in; None when no tool may be called."""
        choice = body.tool_choice or ("auto" if body.tools else "none")
        if not body.tools:
            if choice != "none":
                raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        fmt = detect_format(self.llm.tokenizer.chat_template if self.llm.tokenizer else None)
        if fmt is None:
            raise OpenAIError(
                400,
                "this model's chat template renders no tools (none of the Hermes/Qwen, Llama 3 or Mistral tool formats); "
                "serve it with `precast serve --chat-template FILE` naming a template that does",
                param="tools",
            )
        return fmt

    def chat_jobs(self, body: ChatCompletionRequest) -> list[Job]:
        fmt = self.tool_format(body)
        # tools are rendered whenever given (with tool_choice "none" too, as vLLM does): the model keeps the context
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            messages = template_messages([m.for_template() for m in body.messages])
            prompt = self.llm.apply_chat_template(messages, tools=tools)
        except PrecastError as e:
            raise OpenAIError(400, str(e), param="messages") from e
        except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
            raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from e
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, self.llm.max_seq_len - len(prompt))
        self.check_length(prompt, max_tokens, "messages")
        top = body.top_logprobs if body.top_logprobs is not None else (0 if body.logprobs else None)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        jobs = [(prompt, self.sampling(body, max_tokens, top, i)) for i in range(body.n)]
        if fmt is not None and tools:
            jobs = [(p, self.tool_sampling(body, fmt, tools, params)) for p, params in jobs]
        self.check_params(jobs)
        return jobs

    def tool_sampling(
        self, body: ChatCompletionRequest, fmt: ToolFormat, tools: list[dict[str, Any]], params: SamplingParams
    ) -> SamplingParams:
        """`required` or a named function: the output is constrained to well-formed calls of those tools.
        Special tokens stay in the text (Mistral's [TOOL_CALLS] is one)."""
        choice = body.tool_choice
        if choice in (None, "auto"):
            return dataclasses.replace(params, skip_special_tokens=False)
        if params.guide() is not None:
            raise OpenAIError(
                400, f"tool_choice {choice!r} cannot be combined with response_format or structured_outputs", param="tool_choice"
            )
        if choice != "required":
            tools = [t for t in tools if t["function"]["name"] == choice.function.name]
            if not tools:
                raise OpenAIError(
                    400, f"tool_choice names function {choice.function.name!r}, which is not among the tools", param="tool_choice"
                )
        try:
            # a named function is called once; `required` may call several unless parallel_tool_calls is false
            parallel = choice == "required" and body.parallel_tool_calls is not False
            grammar = fmt.grammar(tools, self.llm.grammar_literal, parallel)
        except PrecastError as e:
            raise OpenAIError(400, str(e), param="tools") from e
        return dataclasses.replace(params, grammar=grammar, skip_special_tokens=False)

    def tokenize(self, body: TokenizeRequest) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give either prompt or messages", param="prompt")
        try:
            if body.messages is not None:
                messages = template_messages([m.for_template() for m in body.messages])
                return self.llm.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
            return self.llm.tokenize(body.prompt or "", add_special_tokens=body.add_special_tokens)
        except PrecastError as e:
            raise OpenAIError(400, str(e)) from e

    def detokenize(self, body: DetokenizeRequest) -> str:
        vocab = self.llm.engine.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        if self.llm.tokenizer is None:
            raise OpenAIError(400, "this engine has no tokenizer")
        return self.llm.tokenizer.decode(body.tokens, skip_special_tokens=False)
