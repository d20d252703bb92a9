"""precast.LLM: the Python API over one C++ Executor.

One dispatcher thread waits on the executor (without the GIL) and hands each response
to the request it belongs to: a queue for the blocking APIs, an asyncio future-backed
queue for coroutines. So many concurrent requests, sync or async, cost one thread.

    llm = LLM("engines/smollm2")
    print(llm.generate("The capital of France is", SamplingParams(temperature=0)).text)
    for out in llm.stream("Tell me a story", SamplingParams(max_tokens=64)):
        print(out.delta, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from precast import _C
from precast.engine.directory import Engine, load_engine
from precast.errors import PrecastError
from precast.runtime.cpu_backend import default_num_threads, make_cpu_runner
from precast.runtime.detokenizer import IncrementalDetokenizer
from precast.runtime.guided import GuidedDecoding
from precast.runtime.sampling_params import SamplingParams, engine_defaults
from precast.runtime.speculative import make_proposer, parse_speculative
from precast.runtime.tensorrt.runner import make_tensorrt_runner
from precast.runtime.tokenizer import Tokenizer

_FINISH_REASONS = {
    _C.FinishReason.LENGTH: "length",
    _C.FinishReason.STOP: "stop",
    _C.FinishReason.CANCELLED: "cancelled",
    _C.FinishReason.ERROR: "error",
}
BACKENDS = ("cpu", "cuda", "tensorrt", "tensorrt-reference")  # docs/gpu.md for cuda, docs/tensorrt.md for the TensorRT ones
DEFAULT_KV_FRACTION = 0.25  # of total RAM, when no --kv-cache-memory is given


@dataclass
class RequestOutput:
    """A request's state after a response: cumulative text and ids, plus what is new."""

    request_id: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # "length", "stop", "cancelled", "error"
    error: str | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: proposed tokens checked for this request, and accepted
    num_accepted_draft_tokens: int = 0
    ends_with_stop_token: bool = False  # the last token is the eos or stop token that ended it (not in the text)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 8 << 30


class _Tracker:
    """Turns one request's raw responses into RequestOutputs (text, stop strings)."""

    def __init__(
        self, core: _Core, request_id: int, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None, guide_id: int
    ):
        self.core = core  # not the LLM: a request in flight must not keep a dropped LLM alive
        self.guide_id = guide_id  # its grammar, freed when the request ends (0: none)
        self.out = RequestOutput(request_id, prompt_ids)
        if params.prompt_logprobs is not None:  # the first prompt token has no log-probability: nothing predicts it
            self.out.prompt_logprobs, self.out.prompt_top_logprobs = [None], [None]
        self.detok = (
            IncrementalDetokenizer(tokenizer, prompt_ids, params.stop, params.skip_special_tokens) if tokenizer is not None else None
        )
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(core.eos_token_ids))

    def update(self, resp: Any) -> RequestOutput | None:
        """The request's new state, or None once it already ended (a stop string ends it
        before the executor's own final response arrives)."""
        o = self.out
        if o.finished:
            return None
        new = list(resp.new_tokens)
        o.token_ids += new
        o.delta_token_ids = new
        o.logprobs += list(resp.logprobs)
        o.top_logprobs += [list(t) for t in resp.top_logprobs]
        if resp.prompt_logprobs:
            o.prompt_logprobs += list(resp.prompt_logprobs)
            o.prompt_top_logprobs += [list(t) for t in resp.prompt_top_logprobs]
        o.num_cached_tokens = max(o.num_cached_tokens, resp.num_cached_prompt_tokens)
        o.num_draft_tokens, o.num_accepted_draft_tokens = resp.num_draft_tokens, resp.num_accepted_draft_tokens
        finished = resp.finished
        if finished:
            o.finish_reason = _FINISH_REASONS[resp.finish_reason]
            o.error = resp.error or None
        o.delta = ""
        if self.detok is not None:
            # A stop token ends the request but is not part of the text.
            o.ends_with_stop_token = finished and o.finish_reason == "stop" and bool(new) and new[-1] in self.stop_ids
            shown = new[:-1] if o.ends_with_stop_token else new
            if self.detok.has_stop_strings:
                # Token by token: a response may carry several (speculative decoding), and the output ends at
                # the one that completes a stop string; any after it are dropped.
                o.delta = ""
                for i, token in enumerate(shown):
                    o.delta += self.detok.add([token], final=finished and i == len(shown) - 1)
                    if self.detok.stopped:
                        extra = len(new) - i - 1  # the tokens after this one (a stop token too)
                        if extra:
                            del o.token_ids[-extra:], o.delta_token_ids[-extra:]
                            del o.logprobs[len(o.token_ids) :], o.top_logprobs[len(o.token_ids) :]
                        break
                if not shown:
                    o.delta = self.detok.add([], final=finished)
            else:
                o.delta = self.detok.add(shown, final=finished)
            if self.detok.stopped:
                # A stop string: the text is cut there and the request ends now.
                if not finished:
                    self.core.executor.cancel(o.request_id)
                o.finish_reason = "stop"
            o.text = self.detok.text
        if o.finished and self.guide_id:
            self.core.guided.remove(self.guide_id)
        return RequestOutput(**{k: (list(v) if isinstance(v, list) else v) for k, v in o.__dict__.items()})


class _Core:
    """The executor and the dispatcher thread that routes its responses to per-request sinks.

    The thread references only this object, never the LLM, so an LLM that is dropped without
    shutdown() is garbage collected; its finalizer (weakref.finalize, which also runs at interpreter
    exit) closes this core. Closing at exit matters: a daemon thread still inside
    `await_responses` when Python finalizes is killed by pthread_exit while it re-takes the GIL,
    which unwinds through C++ and aborts the process ("terminate called without an active exception").
    """

    def __init__(self, executor: Any, eos_token_ids: list[int], guided: GuidedDecoding):
        self.executor = executor
        self.eos_token_ids = eos_token_ids
        self.guided = guided
        self.lock = threading.Lock()
        self.sinks: dict[int, Callable[[Any], None]] = {}
        self.closed = False
        self.thread = threading.Thread(target=self._dispatch, name="precast-dispatch", daemon=True)
        self.thread.start()

    def _dispatch(self) -> None:
        while True:
            closed = self.closed  # read before waiting: after close, one empty wait means all is routed
            responses = self.executor.await_responses(0.1)
            for resp in responses:
                with self.lock:
                    sink = self.sinks.get(resp.request_id)
                    if resp.finished:
                        self.sinks.pop(resp.request_id, None)
                if sink is not None:
                    sink(resp)
            if closed and not responses:
                return

    def close(self) -> None:
        if self.closed:
            return
        self.executor.shutdown()  # joins the loop thread; unfinished requests get their final (error) response
        self.closed = True
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)


class LLM:
    def __init__(
        self,
        engine: str | Path,
        *,
        backend: str = "cpu",
        kv_cache_memory: int | None = None,
        num_threads: int | None = None,
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        chunked_prefill: bool = True,
        prefix_reuse: bool = True,
        chat_template: str | None = None,
        kv_events: bool = False,
        speculative: str | None = None,
        num_draft_tokens: int | None = None,
        matmul_precision: str | None = None,
    ) -> None:
        """`chat_template`: Jinja source used instead of the engine's own (for instance one that renders tools).
        `kv_events`: record prefix-cache changes for take_kv_events() (KV-aware routing).
        `speculative`: "ngram" or "draft=ENGINE_DIR" (runtime/speculative.py), with up to `num_draft_tokens`
        proposed tokens per request and step; a request opts out with SamplingParams(speculative=False).
        `matmul_precision` (backends "cpu" and "cuda", runtime/precision.py): "weights" (default: the chip's bf16
        dot-product units / tensor cores where the engine's weights allow) or "float32" (IEEE float32 throughout)."""
        self.engine: Engine = load_engine(engine)
        limits = self.engine.config.limits
        self.speculation = None if speculative is None else parse_speculative(speculative, num_draft_tokens)
        if speculative is None and num_draft_tokens is not None:
            raise PrecastError("num_draft_tokens needs speculative= (ngram or draft=ENGINE_DIR)")
        if self.speculation is not None and backend not in ("cpu", "cuda"):
            raise PrecastError(
                f"speculative decoding runs on the cpu and cuda backends; the {backend} runner returns no logits per draft token"
            )
        if matmul_precision is not None and backend not in ("cpu", "cuda"):
            raise PrecastError(f"matmul_precision is an option of backends 'cpu' and 'cuda'; the {backend} runner has its own")
        self.num_threads: int | None = None  # CPU threads; None on a GPU backend
        if backend == "cpu":
            self.num_threads = num_threads or default_num_threads()
            self._runner = make_cpu_runner(self.engine, self.num_threads, matmul_precision=matmul_precision or "weights")
        elif backend == "cuda":  # docs/gpu.md: precast's Triton kernels; imports torch and triton only here
            from precast.runtime.cuda import make_cuda_runner

            self._runner = make_cuda_runner(self.engine, matmul_precision or "weights")
        elif backend in ("tensorrt", "tensorrt-reference"):  # docs/tensorrt.md: GPU-only / numpy reference
            self._runner = make_tensorrt_runner(self.engine, reference=backend == "tensorrt-reference")
        else:
            raise PrecastError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)} (tensorrt: an NVIDIA GPU)")
        self.tokenizer = Tokenizer(self.engine) if self.engine.config.tokenizer else None
        if chat_template is not None:
            if self.tokenizer is None:
                raise PrecastError("a chat template needs the engine's tokenizer; this engine has none")
            self.tokenizer.chat_template = chat_template
        self.eos_token_ids: list[int] = list((self.engine.config.tokenizer or {}).get("eos_token_ids") or [])

        config = _C.ExecutorConfig()
        config.max_batch_size = _within("max_batch_size", max_batch_size, limits.max_batch_size)
        config.max_num_tokens = _within("max_num_tokens", max_num_tokens, limits.max_num_tokens)
        config.max_seq_len = limits.max_seq_len
        config.tokens_per_block = limits.tokens_per_block
        config.chunked_prefill = chunked_prefill
        config.prefix_reuse = prefix_reuse
        config.kv_events = kv_events
        config.eos_token_ids = self.eos_token_ids
        config.kv_cache_bytes = kv_cache_memory if kv_cache_memory is not None else self._default_kv_bytes(config)
        # Structured outputs: grammars by guide id; llguidance's tokenizer is built at the first guided request.
        tokenizer_file = self.engine.tokenizer_path if self.tokenizer is not None else None
        self._guided = GuidedDecoding(tokenizer_file, self._runner.vocab_size(), self.eos_token_ids)
        proposer = None
        if self.speculation is not None:
            proposer, config.speculative = make_proposer(self.speculation, self.engine, self.num_threads or 1, config.kv_cache_bytes)
        try:
            self._executor = _C.Executor(config, self._runner, self._guided, proposer)
        except ValueError as e:
            raise PrecastError(str(e)) from e
        self.max_seq_len = limits.max_seq_len
        self._limits = limits
        self._core = _Core(self._executor, self.eos_token_ids, self._guided)
        self._finalizer = weakref.finalize(self, self._core.close)  # on shutdown(), garbage collection or exit

    def _default_kv_bytes(self, config: Any) -> int:
        """Enough for every request at full length, capped at a quarter of the machine's RAM: the total,
        not what happens to be free at start, so the same engine gets the same pool on every start."""
        full = config.max_batch_size * config.max_seq_len
        block = config.tokens_per_block  # the element can depend on the block size (the CPU's bf16 pairs)
        per_token = self._runner.kv_block_bytes(block) / block
        device_cap = getattr(self._runner, "kv_memory_cap", lambda: None)()  # the cuda runner on a GPU: its memory
        cap = device_cap if device_cap is not None else total_ram_bytes() * DEFAULT_KV_FRACTION
        return int(min(full * per_token, cap))

    def describe_resources(self) -> str:
        """What this LLM holds, for a server's start line: the KV pool and the threads."""
        kv = self._executor.stats().kv
        blocks = kv.free_blocks + kv.used_blocks + kv.cached_blocks
        pool_bytes = blocks * self._runner.kv_block_bytes(kv.tokens_per_block)
        return (
            f"KV cache {blocks:,} blocks x {kv.tokens_per_block} tokens = {blocks * kv.tokens_per_block:,} tokens "
            f"({pool_bytes / 2**20:,.0f} MiB); batch {self._limits.max_batch_size}, seq {self.max_seq_len}"
            + (f"; {self.num_threads} CPU threads" if self.num_threads else "")
        )

    def default_sampling_params(self, **given: Any) -> SamplingParams:
        """SamplingParams from the engine's generation defaults (its checkpoint's generation_config.json),
        with `given` fields on top; what generate() and stream() use when no params are passed."""
        return SamplingParams(**(engine_defaults(self.engine.config.generation) | given))

    # ---- requests -------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The token ids a prompt runs as: text tokenized, ids checked to be a list of ints."""
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, list | tuple) or not all(isinstance(t, int) for t in prompt):
            raise PrecastError("a prompt is a string or a list of token ids")
        return list(prompt)

    def prepare_output_format(self, params: SamplingParams) -> None:
        """Compile params' output format, if any, into the grammar cache now; PrecastError when it cannot be."""
        guide = params.guide()
        if guide is not None:
            self._guided.prepare(*guide)

    def grammar_literal(self, text: str) -> str:
        """`text` as a literal in a grammar for this engine's tokenizer (runtime/guided.py)."""
        return self._guided.grammar_literal(text)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids, as a prompt of this text would run (add_special_tokens: the tokenizer's BOS)."""
        return self._encode(text, add_special_tokens)

    def _request(self, prompt_ids: list[int], params: SamplingParams, streaming: bool) -> Any:
        """The C++ request; its grammar (if the params name an output format) is registered last, so a
        request refused here leaves none behind."""
        params.validate()
        bad_words: set[tuple[int, ...]] = set()
        if params.bad_words:
            if self.tokenizer is None:
                raise PrecastError("bad_words need a tokenizer")
            for w in params.bad_words:  # the word alone and after a space tokenize differently
                for variant in (w, " " + w.lstrip()):
                    bad_words.add(tuple(self.tokenizer.encode(variant, add_special_tokens=False)))
        req = params.to_request(prompt_ids, streaming, [list(w) for w in bad_words if w])
        guide = params.guide()
        if guide is not None:
            req.guide_id = self._guided.add(*guide)
        return req

    def _submit(
        self, prompt: str | list[int], params: SamplingParams, streaming: bool, sink_for: Callable[[_Tracker], Callable[[Any], None]]
    ) -> _Tracker:
        if self._core.closed:
            raise PrecastError("this LLM has been shut down")
        prompt_ids = self.prompt_ids(prompt)
        req = self._request(prompt_ids, params, streaming)
        core = self._core
        with core.lock:  # the dispatcher routes nothing for this id before its sink exists
            try:
                request_id = self._executor.enqueue(req)
            except (ValueError, RuntimeError) as e:
                self._guided.remove(req.guide_id)
                raise PrecastError(str(e)) from e
            tracker = _Tracker(core, request_id, prompt_ids, params, self.tokenizer, req.guide_id)
            core.sinks[request_id] = sink_for(tracker)
        return tracker

    # ---- blocking API ---------------------------------------------------------------
    def generate(
        self, prompts: str | list[int] | list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> Any:
        """Generate for one prompt (returns a RequestOutput) or a list (returns a list), all in flight together;
        `params` is one SamplingParams for all, or one per prompt."""
        # An empty list is an (invalid) empty prompt, not an empty batch.
        single = isinstance(prompts, str) or (isinstance(prompts, list) and (not prompts or isinstance(prompts[0], int)))
        batch = [prompts] if single else list(prompts)
        per_prompt = params if isinstance(params, list) else [params or self.default_sampling_params()] * len(batch)
        if len(per_prompt) != len(batch):
            raise PrecastError(f"{len(per_prompt)} SamplingParams for {len(batch)} prompts; give one, or one per prompt")
        done: queue.Queue[RequestOutput] = queue.Queue()
        trackers = []
        for p, sp in zip(batch, per_prompt):
            trackers.append(self._submit(p, sp, False, lambda t: lambda r, t=t: _put(done.put, t.update(r))))
        results: dict[int, RequestOutput] = {}
        while len(results) < len(trackers):
            out = done.get()
            if out.finished:
                results[out.request_id] = out
        ordered = [results[t.out.request_id] for t in trackers]
        return ordered[0] if single else ordered

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput per generated token (delta = the new text); the last one is finished.
        Closing the iterator early cancels the request."""
        updates: queue.Queue[RequestOutput] = queue.Queue()
        tracker = self._submit(prompt, params or self.default_sampling_params(), True, lambda t: lambda r: _put(updates.put, t.update(r)))
        finished = False
        try:
            while not finished:
                out = updates.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.cancel(tracker.out.request_id)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate(self.apply_chat_template(messages), params)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        if self.tokenizer is None:
            raise PrecastError("this engine has no tokenizer")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools)
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise PrecastError("this engine has no tokenizer; pass token ids")
        # A token spans at most max_token_chars characters of the vocabulary; x4 covers normalizers that
        # contract text (combining sequences, NFKC). Longer text cannot fit max_seq_len tokens.
        most = self.max_seq_len * self.tokenizer.max_token_chars * 4
        if len(text) > most:
            raise PrecastError(
                f"the prompt has {len(text):,} characters, far more than this engine's max_seq_len of {self.max_seq_len} "
                "tokens can hold; shorten it"
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ---- asyncio API ----------------------------------------------------------------
    async def generate_async(self, prompt: str | list[int], params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Async stream of RequestOutputs for one request; cancelling the consumer cancels the request."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink_for(t: _Tracker) -> Callable[[Any], None]:
            def sink(r: Any) -> None:
                out = t.update(r)
                if out is not None:
                    loop.call_soon_threadsafe(updates.put_nowait, out)

            return sink

        tracker = self._submit(prompt, params or self.default_sampling_params(), True, sink_for)
        finished = False
        try:
            while not finished:
                out = await updates.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.cancel(tracker.out.request_id)

    # ---- control --------------------------------------------------------------------
    def cancel(self, request_id: int) -> bool:
        return self._executor.cancel(request_id)

    def stats(self) -> Any:
        return self._executor.stats()

    @property
    def num_kv_blocks(self) -> int:
        """KV cache blocks in the pool (the budget, kv_cache_memory, divided by one block's bytes)."""
        return self._executor.num_kv_blocks

    def take_kv_events(self) -> tuple[list[tuple[bool, int, int | None, list[int]]], int]:
        """Prefix-cache changes since the last call, oldest first: ([(stored, block hash, parent hash or None, token
        ids)], how many were dropped because they piled up). Needs LLM(kv_events=True)."""
        return self._executor.take_kv_events()

    def check_integrity(self) -> None:
        self._executor.check_integrity()

    def check_alive(self) -> None:
        """Raises PrecastError unless requests can still be served (health checks: Ray Serve's replica check)."""
        if self._core.closed:
            raise PrecastError("the LLM was shut down")
        if not self._core.thread.is_alive():
            raise PrecastError("the LLM's response dispatcher thread died; restart the process")
        self._executor.stats()  # the executor answers

    def shutdown(self) -> None:
        """Stop the executor (requests in flight end as cancelled) and its threads. Idempotent; also done
        when the LLM is garbage collected or the interpreter exits."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _put(put: Callable[[RequestOutput], None], out: RequestOutput | None) -> None:
    if out is not None:
        put(out)


def _within(name: str, value: int | None, limit: int) -> int:
    if value is None:
        return limit
    if not 1 <= value <= limit:
        raise PrecastError(
            f"{name}={value} is outside the engine's build limit (1..{limit}); rebuild with a larger --{name.replace('_', '-')}"
        )
    return value
