"""precast against llama.cpp and HF transformers on one packaged model (SmolLM2-135M-Instruct by default;
Qwen2.5-Coder-0.5B / 1.5B-Instruct with --model), same prompts and threads, one run.

Engines:
  precast       float32, bfloat16, and fp8 / nvfp4 / int4_awq with the LM head quantized too (as llama.cpp's
                files are; the rest bfloat16)
  transformers  float32, bfloat16 (the GGUF loaded by transformers)
  llama.cpp     through llama-cpp-python: the package's GGUF as shipped (Q4_1), and Q8_0 / F16 made from it with
                llama.cpp's own quantizer (llama_model_quantize)
Measures (median of --repeats, spread min..max):
  decode    batch-1 decode tokens/s (128 tokens after a short chat prompt)
  prefill   tokens/s for a 512-token prompt (and --long-prefill tokens, 2048 by default; 0 skips it), one request,
            first token included
  TTFT      ms to the first token of the short chat prompt
  32-way    output tokens/s for 32 concurrent requests of 128 prompt / 128 output tokens; llama.cpp through its
            low-level batch API with 32 sequences in one context (every step decodes one token of each)
and this machine's memory bandwidth (STREAM-like read / copy / triad, all threads), with batch-1 decode as a
fraction of its limit: weight bytes streamed per token / read bandwidth. Bytes streamed per token ("MiB read per
token") leave out an embedding table that the LM head does not share (a token reads one row of it): the engines'
files hold such a table (Qwen2.5-Coder-1.5B: 445 MiB in bf16, 125 in llama.cpp's Q4_K), and counting it inflated
every "% of the limit" before 2026-12-07.

llama-cpp-python builds from source (minutes): it lives in the `bench` extra, never installed by CI:
    pip install -e ".[bench]"
    python benchmarks/compare_cpu.py [--model qwen2.5-coder-1.5b-instruct] [--repeats 3] [--threads N] [--skip-hf]
        [--skip-llamacpp] [--precast bfloat16 fp8 ...]

precast's bf16 / fp8 / nvfp4 / int4 layers multiply on the CPU's bf16 dot-product units where it has them (AMX, else
AVX512-BF16; docs/design.md); PRECAST_CPU_DOT=float32 in the environment measures the float32 path instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from precast.errors import PrecastError
from precast.packaged import PACKAGED_MODELS, resolve_model_name

DECODE_TOKENS = 128
PREFILL_TOKENS = 512
LONG_PREFILL = 2048  # --long-prefill
MODELS = list(PACKAGED_MODELS)  # SmolLM2 first: the default
BATCH, BATCH_IN, BATCH_OUT = 32, 128, 128
CHAT = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def model_arg(name: str) -> str:
    """--model: a packaged model's name or a prefix naming one only (`qwen2.5-coder-1.5b`)."""
    try:
        return resolve_model_name(name)
    except PrecastError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def cpu_name() -> str:
    """The CPU's model name, for every benchmark table (the machine varies between sessions)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


@dataclass
class Result:
    engine: str
    family: str  # precast | transformers | llama.cpp
    weight_bytes: int  # streamed per decode step (for the bandwidth limit): not an embedding table the LM head does not share
    decode: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    prefill_long: list[float] = field(default_factory=list)  # LONG_PREFILL tokens
    ttft_ms: list[float] = field(default_factory=list)
    batch: list[float] = field(default_factory=list)
    # Read bandwidth measured just before each decode run: this host's bandwidth swings up to 2x from one second to
    # the next (benchmarks/bandwidth.py), so a share of "the limit" is only honest against the same moment's.
    read_bandwidth: list[float] = field(default_factory=list)

    def bandwidth_share(self, fallback: float) -> float:
        """Median over runs of decode bytes/s over the read bandwidth measured with it (`fallback` if none was)."""
        if len(self.read_bandwidth) != len(self.decode):
            return med(self.decode) * self.weight_bytes / fallback
        return med([d * self.weight_bytes / bw for d, bw in zip(self.decode, self.read_bandwidth)])


def read_bandwidth_now(threads: int) -> float:
    from precast import _C

    return _C.memory_bandwidth("read", 256 << 20, threads, 2)


def smollm2_bf16_engine(out: Path, max_seq_len: int) -> Path:
    """SmolLM2-135M-Instruct as a bfloat16 engine at `out`, built from the packaged GGUF (the small benchmarks' model)."""
    from precast.builder.build import BuildOptions, build_engine
    from precast.packaged import packaged_model_path

    build_engine(BuildOptions(packaged_model_path("smollm2-135m-instruct"), out, dtype="bfloat16", max_seq_len=max_seq_len, progress=False))
    return out


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cell(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    return f"{med(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


# ---------------------------------------------------------------------------------------- precast
def precast_streamed_bytes(engine: Path) -> int:
    """The weights a decode step reads: the whole weights file, less the embedding table where the LM head is a tensor
    of its own (a token reads one row of the table), and less half of int4's group scales and offsets, which the file
    stores as float32 and the CPU runner holds in bf16 (plugins/cpu/kernels.h)."""
    from precast.engine.safetensors_file import SafetensorsFile

    tensors = SafetensorsFile(engine / "weights.safetensors").tensors
    total = (engine / "weights.safetensors").stat().st_size
    total -= sum(t.nbytes // 2 for n, t in tensors.items() if n.endswith((".weight_scale", ".weight_offset")) and t.dtype == "F32")
    return total - tensors["embed.weight"].nbytes if "lm_head.weight" in tensors and "embed.weight" in tensors else total


def bench_precast(name: str, engine: Path, threads: int, repeats: int, chat_ids: list[int]) -> Result:
    from precast.runtime import LLM, SamplingParams

    rng = np.random.default_rng(0)
    long_prompt = rng.integers(100, 40000, PREFILL_TOKENS).tolist()
    prompts = [rng.integers(100, 40000, BATCH_IN).tolist() for _ in range(BATCH)]
    r = Result(name, "precast", precast_streamed_bytes(engine))
    greedy = dict(temperature=0, ignore_eos=True)
    with LLM(engine, num_threads=threads, prefix_reuse=False, kv_cache_memory=2 << 30) as llm:
        llm.generate(chat_ids, SamplingParams(max_tokens=8))  # warm-up
        for _ in range(repeats):
            r.read_bandwidth.append(read_bandwidth_now(threads))
            t0 = time.perf_counter()
            first = None
            for _out in llm.stream(chat_ids, SamplingParams(max_tokens=DECODE_TOKENS + 1, **greedy)):
                if first is None:
                    first = time.perf_counter()
            r.decode.append(DECODE_TOKENS / (time.perf_counter() - first))
            r.ttft_ms.append((first - t0) * 1e3)
            t0 = time.perf_counter()
            llm.generate(long_prompt, SamplingParams(max_tokens=1, **greedy))
            r.prefill.append(PREFILL_TOKENS / (time.perf_counter() - t0))
            if LONG_PREFILL:
                t0 = time.perf_counter()
                llm.generate(rng.integers(100, 40000, LONG_PREFILL).tolist(), SamplingParams(max_tokens=1, **greedy))
                r.prefill_long.append(LONG_PREFILL / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=BATCH_OUT, **greedy))
            assert all(len(o.token_ids) == BATCH_OUT for o in outs)
            r.batch.append(BATCH * BATCH_OUT / (time.perf_counter() - t0))
    return r


def prefill_ab(engine: Path, model, threads: int, rounds: int) -> tuple[list[float], list[float]]:
    """precast and HF float32 512-token prefill measured in alternation, `rounds` times: a shared machine that
    speeds up or slows down during the run then weighs on both alike (the sequential rows above are minutes apart)."""
    import torch

    from precast.runtime import LLM, SamplingParams

    torch.set_num_threads(threads)
    prompt = np.random.default_rng(0).integers(100, 40000, PREFILL_TOKENS).tolist()
    ours, theirs = [], []
    with LLM(engine, num_threads=threads, prefix_reuse=False, kv_cache_memory=2 << 30) as llm, torch.inference_mode():
        llm.generate(prompt[:16], SamplingParams(max_tokens=2))
        model.generate(torch.tensor([prompt[:16]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        for _ in range(rounds):
            t0 = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            ours.append(PREFILL_TOKENS / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
            theirs.append(PREFILL_TOKENS / (time.perf_counter() - t0))
    return ours, theirs


# ----------------------------------------------------------------------------------- transformers
def bench_hf(name: str, model, threads: int, repeats: int, chat_ids: list[int], weight_bytes: int, batch: bool = True) -> Result:
    import torch

    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    long_prompt = torch.tensor([rng.integers(100, 40000, PREFILL_TOKENS).tolist()])
    prompts = torch.tensor([rng.integers(100, 40000, BATCH_IN).tolist() for _ in range(BATCH)])
    ids = torch.tensor([chat_ids])
    r = Result(name, "transformers", weight_bytes)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, **kw)
        for _ in range(repeats):
            r.read_bandwidth.append(read_bandwidth_now(threads))
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kw)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=DECODE_TOKENS + 1, **kw)
            t2 = time.perf_counter()
            r.ttft_ms.append((t1 - t0) * 1e3)
            r.decode.append(DECODE_TOKENS / ((t2 - t1) - (t1 - t0)))
            t0 = time.perf_counter()
            model.generate(long_prompt, max_new_tokens=1, **kw)
            r.prefill.append(PREFILL_TOKENS / (time.perf_counter() - t0))
            if LONG_PREFILL:
                t0 = time.perf_counter()
                model.generate(torch.tensor([rng.integers(100, 40000, LONG_PREFILL).tolist()]), max_new_tokens=1, **kw)
                r.prefill_long.append(LONG_PREFILL / (time.perf_counter() - t0))
            if batch:  # one padded batch through `generate` (slow)
                t0 = time.perf_counter()
                model.generate(prompts, max_new_tokens=BATCH_OUT, attention_mask=torch.ones_like(prompts), **kw)
                r.batch.append(BATCH * BATCH_OUT / (time.perf_counter() - t0))
    return r


# -------------------------------------------------------------------------------------- llama.cpp
class LlamaCpp:
    """The low-level llama.cpp API: one context, up to BATCH sequences, greedy sampling in numpy."""

    def __init__(self, path: Path, threads: int, use_extra_bufts: bool = True) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.use_extra_bufts = use_extra_bufts  # AMX / repacked weight layouts
        self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        params = lc.llama_context_default_params()
        params.n_ctx = BATCH * (BATCH_IN + BATCH_OUT + 8)
        params.n_batch = params.n_ubatch = max(PREFILL_TOKENS, BATCH * BATCH_IN)
        params.n_seq_max = BATCH
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = params.n_batch
        self.batch = lc.llama_batch_init(params.n_batch, 0, BATCH)

    def decode_only(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits) through llama_decode; logits stay in the context."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence, wants logits); returns the greedy next token per logits row."""
        self.decode_only(items)
        out = []
        for i, item in enumerate(items):
            if item[3]:
                row = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits at every position of one sequence read from an empty cache ([len(tokens), vocab], a copy)."""
        self.clear()
        rows = []
        for start in range(0, len(tokens), self.n_batch):  # the batch holds n_batch tokens
            chunk = tokens[start : start + self.n_batch]
            self.decode_only([(t, start + i, 0, True) for i, t in enumerate(chunk)])
            rows += [
                np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy() for i in range(len(chunk))
            ]
        return np.stack(rows)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def bench_llamacpp(name: str, path: Path, threads: int, repeats: int, chat_ids: list[int]) -> Result:
    """In a child process (llama.cpp's AMX path crashes on some virtual machines): with its extra buffer
    types (AMX, repacked layouts) first, without them if that run dies."""
    for extra in (True, False):
        cmd = [sys.executable, __file__, "--llamacpp-worker", json.dumps([name, str(path), threads, repeats, chat_ids, extra])]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            r = Result(**json.loads(done.stdout.strip().splitlines()[-1]))
            if not extra:
                r.engine += " (no AMX/repack: crashed with them)"
            return r
    raise RuntimeError(f"llama.cpp failed on {path}: {done.stderr[-2000:]}")


def _llamacpp_worker(spec: str) -> None:
    name, path, threads, repeats, chat_ids, extra = json.loads(spec)
    r = _bench_llamacpp(name, Path(path), threads, repeats, chat_ids, extra)
    print(json.dumps(r.__dict__))


def _bench_llamacpp(name: str, path: Path, threads: int, repeats: int, chat_ids: list[int], extra: bool) -> Result:
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(100, 40000, PREFILL_TOKENS).tolist()
    prompts = [rng.integers(100, 40000, BATCH_IN).tolist() for _ in range(BATCH)]
    r = Result(name, "llama.cpp", gguf_streamed_bytes(path))
    ll = LlamaCpp(path, threads, use_extra_bufts=extra)
    try:
        for rep in range(repeats + 1):  # the first round warms up
            bandwidth = read_bandwidth_now(threads)
            ll.clear()
            t0 = time.perf_counter()
            (tok,) = ll.decode([(t, p, 0, p == len(chat_ids) - 1) for p, t in enumerate(chat_ids)])
            first = time.perf_counter()
            for step in range(DECODE_TOKENS):
                (tok,) = ll.decode([(tok, len(chat_ids) + step, 0, True)])
            decode = DECODE_TOKENS / (time.perf_counter() - first)
            ll.clear()
            t1 = time.perf_counter()
            ll.decode([(t, p, 0, p == PREFILL_TOKENS - 1) for p, t in enumerate(long_prompt)])
            prefill = PREFILL_TOKENS / (time.perf_counter() - t1)
            prefill_long = None
            if LONG_PREFILL:
                ll.clear()
                long = rng.integers(100, 40000, LONG_PREFILL).tolist()
                t1 = time.perf_counter()
                for start in range(0, LONG_PREFILL, PREFILL_TOKENS):  # n_batch is PREFILL_TOKENS
                    ll.decode([(t, p, 0, p == LONG_PREFILL - 1) for p, t in enumerate(long) if start <= p < start + PREFILL_TOKENS])
                prefill_long = LONG_PREFILL / (time.perf_counter() - t1)
            ll.clear()
            t2 = time.perf_counter()
            nxt = ll.decode([(t, p, s, p == BATCH_IN - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)])
            for step in range(BATCH_OUT - 1):
                nxt = ll.decode([(nxt[s], BATCH_IN + step, s, True) for s in range(BATCH)])
            batch = BATCH * BATCH_OUT / (time.perf_counter() - t2)
            if rep:
                r.read_bandwidth.append(bandwidth)
                r.decode.append(decode)
                r.ttft_ms.append((first - t0) * 1e3)
                r.prefill.append(prefill)
                if prefill_long is not None:
                    r.prefill_long.append(prefill_long)
                r.batch.append(batch)
    finally:
        ll.close()
    return r


def shipped_type(gguf: Path) -> str:
    """The quantization a GGUF was shipped in (general.file_type): SmolLM2's is Q4_1, the Qwen2.5-Coder files' Q4_K_M."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields["general.file_type"]
    return {1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 15: "Q4_K_M"}.get(int(field.parts[-1][0]), "shipped")


FTYPES = {  # llama.cpp file types made here, by their llama_cpp constant
    "F16": "LLAMA_FTYPE_MOSTLY_F16",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
}


def llamacpp_quantize(source: Path, target: Path, label: str) -> Path:
    """`source` requantized to `label` (a FTYPES name) by llama.cpp's own quantizer, the output tensor too."""
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, FTYPES[label])
    params.allow_requantize = True
    params.quantize_output_tensor = True
    if lc.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize to {label} failed")
    return target


def gguf_streamed_bytes(path: Path) -> int:
    """A GGUF file's size less its token embedding table where it has a separate output (LM head) tensor."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = path.stat().st_size
    return total - int(tensors["token_embd.weight"].n_bytes) if "output.weight" in tensors and "token_embd.weight" in tensors else total


def llamacpp_files(shipped: Path, out: Path) -> dict[str, Path]:
    """The shipped file, and Q8_0 and F16 made from it by llama.cpp's quantizer."""
    files = {f"{shipped_type(shipped)} (shipped)": shipped}
    for label in ("Q8_0", "F16"):
        files[f"{label} (requantized)"] = llamacpp_quantize(shipped, out / f"{shipped.stem}-{label.lower()}.gguf", label)
    return files


# ------------------------------------------------------------------------------------------- main
def main() -> None:
    global LONG_PREFILL
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_arg, default=MODELS[0], help=f"a packaged model or a prefix of one: {', '.join(MODELS)}")
    parser.add_argument("--long-prefill", type=int, default=LONG_PREFILL, help="tokens of the long prefill (0: skip)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: all cores this process may use")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument(
        "--precast",
        nargs="*",
        default=["float32", "bfloat16", "fp8", "nvfp4", "int4_awq"],
        help="float32, bfloat16, recipes or their variants (RECIPE:VARIANT, e.g. int4_awq:symmetric)",
    )
    parser.add_argument("--llamacpp-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llamacpp_worker:
        return _llamacpp_worker(args.llamacpp_worker)

    from precast import _C
    from precast.builder.build import BuildOptions, build_engine
    from precast.engine.directory import load_engine
    from precast.packaged import packaged_model_path
    from precast.quantization.recipe import QuantOptions, parse_recipe_variant
    from precast.runtime.cpu_backend import default_num_threads
    from precast.runtime.tokenizer import Tokenizer

    LONG_PREFILL = args.long_prefill
    threads = args.threads or default_num_threads()
    bandwidth = {k: _C.memory_bandwidth(k, 256 << 20, threads, 5) for k in ("read", "copy", "triad")}
    gguf = packaged_model_path(args.model)
    results: list[Result] = []
    ab: tuple[list[float], list[float]] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        chat_ids: list[int] = []
        for variant in args.precast:
            dense = variant in ("float32", "bfloat16")
            recipe, fields = ("none", {}) if dense else parse_recipe_variant(variant)
            dtype = variant if dense else "bfloat16"
            engine = tmp_path / variant.replace(":", "-")
            build_engine(
                BuildOptions(
                    gguf,
                    engine,
                    dtype=dtype,
                    max_seq_len=max(2048, LONG_PREFILL + 16),
                    progress=False,
                    quant=QuantOptions(recipe=recipe, quantize_lm_head=recipe != "none", **fields),
                )
            )
            if not chat_ids:
                tok = Tokenizer(load_engine(engine))
                chat_ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
            label = variant if recipe == "none" else f"{variant} (head too)"
            results.append(bench_precast(label, engine, threads, args.repeats, chat_ids))
        if not chat_ids:  # no precast engine asked for: the tokenizer still comes from one
            build_engine(BuildOptions(gguf, tmp_path / "tok", progress=False))
            tok = Tokenizer(load_engine(tmp_path / "tok"))
            chat_ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
        if not args.skip_hf:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
            n = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
            if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
                n -= model.get_input_embeddings().weight.numel()  # untied: a token reads one row of the table
            results.append(bench_hf("float32", model, threads, args.repeats, chat_ids, 4 * n))
            if "float32" in args.precast:
                ab = prefill_ab(tmp_path / "float32", model, threads, max(5, 2 * args.repeats))
            results.append(bench_hf("bfloat16", model.to(torch.bfloat16), threads, args.repeats, chat_ids, 2 * n))
        if not args.skip_llamacpp:
            for label, path in llamacpp_files(gguf, tmp_path).items():
                results.append(bench_llamacpp(label, path, threads, args.repeats, chat_ids))

    print(
        f"\n{args.model}, {cpu_name()}, precast's dot-product unit {_C.dot_unit()}, {threads} threads, median of {args.repeats} (min..max). Memory bandwidth "
        f"(all threads): read {bandwidth['read'] / 1e9:.1f} GB/s, copy {bandwidth['copy'] / 1e9:.1f}, "
        f"triad {bandwidth['triad'] / 1e9:.1f}\n"
    )
    print(
        f"| engine | family | MiB read per token | batch-1 decode tok/s | of read-bandwidth limit | prefill tok/s (512) | prefill tok/s ({LONG_PREFILL}) | TTFT ms | 32-way tok/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        limit = (med(r.read_bandwidth) if r.read_bandwidth else bandwidth["read"]) / r.weight_bytes
        print(
            f"| {r.engine} | {r.family} | {r.weight_bytes / 2**20:.0f} | {cell(r.decode)} | {r.bandwidth_share(bandwidth['read']):.0%} "
            f"(limit {limit:.0f}) | {cell(r.prefill)} | {cell(r.prefill_long)} | {cell(r.ttft_ms)} | {cell(r.batch)} |"
        )
    if ab:
        print(
            f"\nfloat32 prefill, precast and HF measured alternately ({len(ab[0])} rounds): precast {cell(ab[0])}, "
            f"transformers {cell(ab[1])} tok/s\n"
        )
    print_targets(results, bandwidth["read"], ab)


def print_targets(results: list[Result], read_bandwidth: float, ab: tuple[list[float], list[float]] | None = None) -> None:
    def get(family: str, prefix: str) -> Result | None:
        return next((r for r in results if r.family == family and r.engine.startswith(prefix)), None)

    rows = []

    def target(what: str, ours: Result | None, theirs: Result | None, key: str, want: float) -> None:
        if ours is None or theirs is None or not getattr(ours, key) or not getattr(theirs, key):
            return
        ratio = med(getattr(ours, key)) / med(getattr(theirs, key))
        rows.append((what, f"{ratio:.2f}x", f">= {want}x", "met" if ratio >= want else "NOT met"))

    four_bit = next((r.engine.split()[0] for r in results if r.family == "llama.cpp" and "shipped" in r.engine), "Q4_1")
    big = four_bit != "Q4_1"  # a Qwen2.5-Coder file: the real-size targets of issue 19
    want = 1.6 if big else 1.2
    target("fp8 decode vs llama.cpp Q8_0", get("precast", "fp8"), get("llama.cpp", "Q8_0"), "decode", want)
    for four in ("nvfp4", "int4_awq"):
        target(f"{four} decode vs llama.cpp {four_bit}", get("precast", four), get("llama.cpp", four_bit), "decode", want)
    for key, tokens in (("prefill", PREFILL_TOKENS), ("prefill_long", LONG_PREFILL)):
        target(f"fp8 prefill {tokens} vs llama.cpp Q8_0", get("precast", "fp8"), get("llama.cpp", "Q8_0"), key, 2.0)
        target(f"int4_awq prefill {tokens} vs llama.cpp {four_bit}", get("precast", "int4_awq"), get("llama.cpp", four_bit), key, 2.0)
        target(f"bfloat16 prefill {tokens} vs HF bfloat16", get("precast", "bfloat16"), get("transformers", "bfloat16"), key, 1.0)
    hf_best = max((r for r in results if r.family == "transformers"), key=lambda r: med(r.decode), default=None)
    best_precast_batch = max((r for r in results if r.family == "precast"), key=lambda r: med(r.batch), default=None)
    target("32-way (best precast) vs HF best batch-1 decode", best_precast_batch, hf_best, "batch", 10.0)
    if best_precast_batch and hf_best:  # the ratio above compares batch throughput with HF's decode rate
        rows[-1] = (
            rows[-1][0],
            f"{med(best_precast_batch.batch) / med(hf_best.decode):.2f}x",
            ">= 10x",
            "met" if med(best_precast_batch.batch) >= 10 * med(hf_best.decode) else "NOT met",
        )
    ll_best = max((r for r in results if r.family == "llama.cpp"), key=lambda r: med(r.batch), default=None)
    target("32-way (best precast) vs llama.cpp's best 32-way", best_precast_batch, ll_best, "batch", 3.0 if big else 1.0)
    if ab:  # the A/B decides: measured alternately, it is the ratio a drifting machine does not skew
        ratio = med(ab[0]) / med(ab[1])
        rows.append(("prefill float32 vs HF float32 (alternating A/B)", f"{ratio:.2f}x", ">= 1.0x", "met" if ratio >= 1.0 else "NOT met"))
    target(
        "prefill float32 vs HF float32 (the sequential rows above)" if ab else "prefill float32 vs HF float32",
        get("precast", "float32"),
        get("transformers", "float32"),
        "prefill",
        1.0,
    )
    if ab:
        rows[-1] = (*rows[-1][:3], "(for reference)")
    # Bandwidth-share targets: issue 19 at real size wants bf16, fp8 and int4_awq each >= 85%; the 135M model's were 70%.
    shares = dict.fromkeys(("bfloat16", "fp8", "int4_awq"), 0.85) if big else dict.fromkeys(("float32", "bfloat16", "fp8"), 0.7)
    for name in ("float32", "bfloat16", "fp8", "nvfp4", "int4_awq"):
        r = get("precast", name)
        if r is not None:
            fraction = r.bandwidth_share(read_bandwidth)
            want = shares.get(name)
            rows.append(
                (
                    f"{name} decode, share of the read-bandwidth limit",
                    f"{fraction:.0%}",
                    f">= {want:.0%}" if want else "reported",
                    ("met" if fraction >= want else "NOT met") if want else "",
                )
            )
    print("\n| target | measured | wanted | |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
