"""precast as an NVIDIA Dynamo backend worker (ai-dynamo's LLMEngine contract, token in, token out).

    python -m precast.runtime.replicas.dynamo_worker ENGINE [--threads N] [--kv-cache-memory 2GiB]
    python -m dynamo.frontend --http-port 8000 [--router-mode kv]          # OpenAI HTTP, routing, detokenizing

Dynamo's frontend reads the model card this worker registers (an HF-style directory it writes from the engine:
config.json, tokenizer.json, tokenizer_config.json with the chat template), tokenizes and renders chat templates,
routes to a worker (round robin, or KV-aware from the KV events this worker publishes), handles stop strings and
detokenizes. The worker runs token ids through one precast LLM. Discovery (etcd, or `--discovery-backend file` on one
machine), request plane (TCP) and event plane (ZMQ) are Dynamo's settings (DYN_* environment variables too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from dynamo.common.backend.engine import EngineConfig, GenerateChunk, GenerateRequest, LLMEngine, LlmRegistration
from dynamo.common.backend.publisher import KvEventSource, PushSource
from dynamo.common.backend.run import run
from dynamo.common.backend.worker import WorkerConfig
from dynamo.llm.exceptions import InvalidArgument

from precast.engine.directory import Engine, load_engine
from precast.errors import PrecastError
from precast.runtime.llm import LLM, RequestOutput
from precast.runtime.sampling_params import SamplingParams
from precast.units import memory_size

# Dynamo's sampling_options -> precast SamplingParams fields of the same meaning.
SAME_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")
# Dynamo's guided_decoding keys -> precast's structured-output fields.
GUIDED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def model_card(engine: Engine, out: Path) -> Path:
    """An HF-style directory describing the engine, which Dynamo's frontend loads (it never reads the weights)."""
    spec = engine.config.model
    tokenizer = engine.config.tokenizer or {}
    eos_token_ids = list(tokenizer.get("eos_token_ids") or [])
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}.get(spec.architecture, "LlamaForCausalLM")],
        "model_type": spec.architecture,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": engine.config.limits.max_seq_len,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": tokenizer.get("bos_token_id"),
        "eos_token_id": eos_token_ids,
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_ids, **engine.config.generation}))
    for name in tokenizer.get("files", []):
        shutil.copyfile(engine.path / name, out / name)
    return out


def sampling_params(llm: LLM, request: GenerateRequest) -> SamplingParams:
    """Dynamo's request -> precast's SamplingParams; what precast cannot do is refused, never dropped. Stop strings
    and skip_special_tokens are Dynamo's (its postprocessor detokenizes)."""
    options = dict(request.get("sampling_options") or {})
    stops = dict(request.get("stop_conditions") or {})
    output = dict(request.get("output_options") or {})
    given: dict[str, Any] = {k: options[k] for k in SAME_FIELDS if options.get(k) is not None}
    if (options.get("n") or 1) != 1 or (options.get("best_of") or 1) != 1 or options.get("use_beam_search"):
        raise PrecastError("precast's Dynamo worker generates one sequence per request: n, best_of and beam search must be 1 / off")
    for name, value in (options.get("guided_decoding") or {}).items():
        if value is None or name == "backend":
            continue
        if name not in GUIDED:
            raise PrecastError(f"guided_decoding.{name} is not supported; use one of {', '.join(GUIDED)}")
        given[GUIDED[name]] = json.loads(value) if name == "json" and isinstance(value, str) else value
    if stops.get("max_tokens") is not None:
        given["max_tokens"] = stops["max_tokens"]
    else:
        given["max_tokens"] = max(1, llm.max_seq_len - len(request["token_ids"]))
    if stops.get("min_tokens"):
        given["min_tokens"] = stops["min_tokens"]
    if stops.get("ignore_eos"):
        given["ignore_eos"] = True
    hidden = [t for t in stops.get("stop_token_ids_hidden") or [] if t not in llm.eos_token_ids]
    if hidden:
        given["stop_token_ids"] = hidden
    if output.get("logprobs") is not None:
        given["logprobs"] = int(output["logprobs"])
    if output.get("prompt_logprobs") is not None:
        raise PrecastError("prompt_logprobs through Dynamo is not supported; use precast serve's echo + logprobs")
    return llm.default_sampling_params(**given)


def chunk(out: RequestOutput, start: int, prompt_tokens: int, logprobs: bool) -> GenerateChunk:
    """The tokens of `out` after `start`, Dynamo's way; the last chunk carries the finish reason and usage."""
    new: GenerateChunk = {"token_ids": out.token_ids[start:], "index": 0}
    if logprobs:
        new["log_probs"] = out.logprobs[start:]
        new["top_logprobs"] = [
            [{"rank": r + 1, "token_id": t, "token": None, "logprob": lp} for r, (t, lp) in enumerate(top)]
            for top in out.top_logprobs[start:]
        ]
    if out.finished:
        if out.finish_reason == "error":
            raise PrecastError(out.error or "generation failed")
        new["finish_reason"] = out.finish_reason or "stop"
        generated = len(out.token_ids)
        new["completion_usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        }
    return new


class PrecastDynamoEngine(LLMEngine):
    def __init__(self, args: argparse.Namespace, served_model_name: str, card_dir: Path):
        self.args, self.served_model_name = args, served_model_name
        self.llm: LLM | None = None
        self.card_dir = card_dir
        self.stop = threading.Event()
        self.publisher_thread: threading.Thread | None = None

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[PrecastDynamoEngine, WorkerConfig]:
        p = argparse.ArgumentParser(prog="python -m precast.runtime.replicas.dynamo_worker", description=__doc__.split("\n\n")[0])
        p.add_argument("engine", help="engine directory")
        p.add_argument("--served-model-name", help="the model name clients send (default: the engine directory's name)")
        p.add_argument("--threads", type=int, help="CPU threads (default: all cores available)")
        p.add_argument("--kv-cache-memory", type=memory_size, help="KV cache size, e.g. 2GiB")
        p.add_argument("--namespace", default="dynamo")
        p.add_argument("--component", default="precast")
        p.add_argument("--endpoint", default="generate")
        p.add_argument("--discovery-backend", default=None, help="etcd (Dynamo's default), file (one machine), kubernetes")
        p.add_argument("--request-plane", default="tcp")
        p.add_argument("--event-plane", default=None, help="zmq (default) or nats")
        p.add_argument("--no-kv-events", action="store_true", help="publish no KV events (the frontend then cannot route by KV)")
        args = p.parse_args(argv)
        name = args.served_model_name or Path(args.engine).resolve().name
        # The frontend loads the model by the path registered as model_name: the card, written before the LLM loads.
        card = model_card(load_engine(args.engine), Path(tempfile.mkdtemp(prefix="precast-dynamo-card-")))
        config = WorkerConfig(
            namespace=args.namespace,
            component=args.component,
            endpoint=args.endpoint,
            model_name=str(card),
            served_model_name=name,
            discovery_backend=args.discovery_backend or os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
            request_plane=args.request_plane,
            event_plane=args.event_plane,
            enable_kv_routing=not args.no_kv_events,
        )
        return cls(args, name, card), config

    async def start(self, worker_id: int) -> EngineConfig:
        self.llm = LLM(
            self.args.engine, num_threads=self.args.threads, kv_cache_memory=self.args.kv_cache_memory, kv_events=not self.args.no_kv_events
        )
        limits = self.llm.engine.config.limits
        print(f"precast dynamo worker {worker_id}: {self.llm.describe_resources()}", flush=True)
        return EngineConfig(
            model=str(self.card_dir),
            served_model_name=self.served_model_name,
            llm=LlmRegistration(
                context_length=self.llm.max_seq_len,
                kv_cache_block_size=limits.tokens_per_block,
                total_kv_blocks=self.llm.num_kv_blocks,
                max_num_seqs=limits.max_batch_size,
                max_num_batched_tokens=limits.max_num_tokens,
            ),
        )

    async def generate(self, request: GenerateRequest, context: Any) -> AsyncGenerator[GenerateChunk, None]:
        assert self.llm is not None
        prompt = list(request["token_ids"])
        try:
            params = sampling_params(self.llm, request)
        except (PrecastError, ValueError) as e:  # bad fields or values: the frontend answers 400 with the message
            raise InvalidArgument(str(e)) from e
        sent = 0
        stream = self.llm.generate_async(prompt, params)
        try:
            async for out in stream:
                if context.is_stopped():  # the client went away: closing the stream cancels the request
                    return
                if len(out.token_ids) > sent or out.finished:
                    yield chunk(out, sent, len(prompt), params.logprobs is not None)
                    sent = len(out.token_ids)
        finally:
            await stream.aclose()

    async def kv_event_sources(self) -> list[KvEventSource]:
        return [] if self.args.no_kv_events else [PushSource(on_ready=self._start_publishing)]

    def _start_publishing(self, publisher: Any) -> None:
        self.publisher_thread = threading.Thread(target=self._publish, args=(publisher,), name="precast-dynamo-kv", daemon=True)
        self.publisher_thread.start()

    def _publish(self, publisher: Any) -> None:
        """precast's prefix-cache changes -> Dynamo's KV events (hashes as signed 64-bit, as Dynamo wants them)."""
        assert self.llm is not None
        block = self.llm.engine.config.limits.tokens_per_block
        signed = lambda h: h - (1 << 64) if h >= 1 << 63 else h
        while not self.stop.wait(0.05):
            events, dropped = self.llm.take_kv_events()
            if dropped:  # Dynamo has no "cleared" event; the router's view is stale until those blocks are reused
                print(f"precast dynamo worker: {dropped} KV events were dropped (more than 1M in 50 ms)", flush=True)
            for stored, block_hash, parent, tokens in events:
                if stored:
                    parent_hash = None if parent is None else signed(parent)
                    publisher.publish_stored(list(tokens), [block], [signed(block_hash)], parent_hash)
                else:
                    publisher.publish_removed([signed(block_hash)])

    async def cleanup(self) -> None:
        self.stop.set()
        if self.publisher_thread is not None:
            self.publisher_thread.join(timeout=5)
        if self.llm is not None:
            self.llm.shutdown()
        shutil.rmtree(self.card_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    run(PrecastDynamoEngine, argv)


if __name__ == "__main__":
    main()
