"""Speculative decoding on the CPU: Qwen2.5-Coder-1.5B-Instruct batch-1 decode with each proposer, against llama.cpp's
own prompt-lookup decoding on the same GGUF, same threads, one run.

Targets (built once into --engines, from the packaged GGUFs): bf16 and int4_awq 1.5B.
Proposers: none | ngram (prompt lookup) | draft: Qwen2.5-Coder-0.5B (bf16 for the bf16 target, int4_awq for the
int4 one) | self: the int4_awq 1.5B drafting for the bf16 1.5B.
Tasks (greedy, chat template):
  edit      rewrite a ~100-line function given in the prompt with one change (a rename)
  chat      open coding chat: write a function from a description
  summary   summarise a given text
Measured: decode tokens/s after the first token (median of --repeats, spread), acceptance (accepted / proposed),
speedup over the same target without a proposer; llama.cpp (llama-cpp-python, `bench` extra) on the shipped
Q4_K_M GGUF plain and with LlamaPromptLookupDecoding. Then 32 concurrent requests with and without n-gram
speculation on the bf16 target (the executor stops proposing when a step decodes more than max_draft_batch).
Every speculative output is checked token for token against the target's plain greedy output.

    pip install -e ".[bench]"      # llama-cpp-python builds from source (minutes)
    python benchmarks/speculative_cpu.py [--repeats 2] [--tokens 192] [--engines DIR] [--skip-llamacpp]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

TASKS = ("edit", "chat", "summary")
TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
SUMMARY_TEXT_LINES = (10, 75)  # docs/design.md: the layout and data flow sections, ~700 words


def task_messages(task: str) -> list[dict[str, str]]:
    if task == "edit":
        from precast.runtime.llm import LLM

        source = inspect.getsource(LLM.__init__)  # a real ~90-line method
        ask = "Rewrite this method with the parameter `kv_cache_memory` renamed to `kv_budget`. Output only the code."
        return [{"role": "user", "content": f"{ask}\n\n```python\n{source}```"}]
    if task == "chat":
        ask = "Write a Python function that parses an INI file into a dict of sections, with a docstring and error handling."
        return [{"role": "user", "content": ask}]
    design = Path(__file__).resolve().parent.parent / "docs" / "design.md"
    text = "\n".join(design.read_text().splitlines()[slice(*SUMMARY_TEXT_LINES)])
    return [{"role": "user", "content": f"Summarise this text in one paragraph:\n\n{text}"}]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cell(values: list[float]) -> str:
    return f"{med(values):.1f} ({min(values):.1f}..{max(values):.1f})" if values else "-"


# ------------------------------------------------------------------------------------------ engines
def build_engines(root: Path) -> dict[str, Path]:
    from precast.builder.build import BuildOptions, build_engine
    from precast.packaged import packaged_model_path
    from precast.quantization.recipe import QuantOptions

    wanted = {
        "1.5b-bf16": (TARGET, "none"),
        "1.5b-int4_awq": (TARGET, "int4_awq"),
        "0.5b-bf16": (DRAFT, "none"),
        "0.5b-int4_awq": (DRAFT, "int4_awq"),
    }
    engines = {}
    for name, (model, quant) in wanted.items():
        out = root / name
        if not (out / "config.json").exists():
            t0 = time.perf_counter()
            options = BuildOptions(
                packaged_model_path(model), out, dtype="bfloat16", max_seq_len=4096, max_batch_size=32, force=True, progress=False,
                quant=QuantOptions(recipe=quant),
            )  # fmt: skip
            build_engine(options)
            print(f"built {name} in {time.perf_counter() - t0:.0f} s", flush=True)
        engines[name] = out
    return engines


# ------------------------------------------------------------------------------------------ precast
def decode_rate(llm, prompt: list[int], tokens: int) -> tuple[float, list[int], int, int]:
    """(tokens/s after the first token, token ids, drafts proposed, drafts accepted) of one greedy request."""
    from precast.runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens)
    first = last = None
    final = None
    for update in llm.stream(prompt, params):
        now = time.perf_counter()
        first, last, final = first or now, now, update
    n = len(final.token_ids)
    rate = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return rate, final.token_ids, final.num_draft_tokens, final.num_accepted_draft_tokens


def bench_precast(engines: dict[str, Path], tokens: int, repeats: int, threads: int) -> list[dict]:
    from precast.runtime import LLM

    rows = []
    setups = {
        "1.5b-bf16": {"none": None, "ngram": "ngram", "draft 0.5B bf16": f"draft={engines['0.5b-bf16']}",
                      "self int4_awq": f"draft={engines['1.5b-int4_awq']}"},
        "1.5b-int4_awq": {"none": None, "ngram": "ngram", "draft 0.5B int4_awq": f"draft={engines['0.5b-int4_awq']}"},
    }  # fmt: skip
    for target, proposers in setups.items():
        plain_ids: dict[str, list[int]] = {}
        plain_rate: dict[str, float] = {}
        for proposer, speculative in proposers.items():
            with LLM(engines[target], num_threads=threads, kv_cache_memory=1 << 30, speculative=speculative) as llm:
                for task in TASKS:
                    prompt = llm.apply_chat_template(task_messages(task))
                    decode_rate(llm, prompt[:64], 8)  # warm-up
                    rates, drafted, accepted = [], 0, 0
                    for _ in range(repeats):
                        rate, ids, d, a = decode_rate(llm, prompt, tokens)
                        rates.append(rate)
                        drafted, accepted = drafted + d, accepted + a
                        if speculative is None:
                            plain_ids[task] = ids
                        elif ids != plain_ids[task]:
                            raise AssertionError(f"{target} + {proposer} on {task}: output differs from plain greedy decoding")
                    if speculative is None:
                        plain_rate[task] = med(rates)
                    rows.append(
                        dict(engine=f"precast {target}", proposer=proposer, task=task, rates=rates,
                             acceptance=accepted / drafted if drafted else None, speedup=med(rates) / plain_rate[task])
                    )  # fmt: skip
                    print(f"  {target:14} {proposer:20} {task:8} {cell(rates)} tok/s", flush=True)
    return rows


def bench_batch(engine: Path, threads: int, tokens: int) -> dict[str, float]:
    """Output tokens/s of 32 concurrent greedy requests (the three tasks' prompts, cycled), plain vs n-gram."""
    from precast.runtime import LLM, SamplingParams

    rates = {}
    for label, speculative in (("plain", None), ("ngram", "ngram")):
        with LLM(engine, num_threads=threads, kv_cache_memory=4 << 30, speculative=speculative) as llm:
            prompts = [llm.apply_chat_template(task_messages(TASKS[i % 3])) for i in range(32)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
            rates[label] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    return rates


# ------------------------------------------------------------------------------------------ llama.cpp
def bench_llamacpp(gguf: Path, tokens: int, repeats: int, threads: int) -> list[dict]:
    """In a child process: llama.cpp's state stays out of precast's, and a crash is reported, not fatal."""
    cmd = [sys.executable, __file__, "--llamacpp-worker", json.dumps([str(gguf), tokens, repeats, threads])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _llamacpp_worker(spec: str) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    gguf, tokens, repeats, threads = json.loads(spec)
    rows, plain_rate = [], {}
    for proposer in ("none", "prompt lookup"):
        draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if proposer != "none" else None
        # Checking drafts reads the logits of every position: llama-cpp-python needs logits_all for it.
        llm = Llama(gguf, n_ctx=4096, n_threads=threads, n_threads_batch=threads, draft_model=draft, logits_all=draft is not None,
                    verbose=False)  # fmt: skip
        for task in TASKS:
            prompt = llm.tokenizer_.tokenize(_chat_text(llm, task).encode(), add_bos=False, special=True)
            rates = []
            for _ in range(repeats + 1):  # the first warms up
                llm.reset()
                first = last = None
                n = 0
                for _chunk in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
                    now = time.perf_counter()
                    first, last, n = first or now, now, n + 1
                    if n >= tokens:
                        break
                rates.append((n - 1) / (last - first))
            rates = rates[1:]
            if proposer == "none":
                plain_rate[task] = med(rates)
            rows.append(dict(engine="llama.cpp Q4_K_M", proposer=proposer, task=task, rates=rates, acceptance=None,
                             speedup=med(rates) / plain_rate[task]))  # fmt: skip
        del llm
    print(json.dumps(rows))


def _chat_text(llm, task: str) -> str:
    """The prompt text through the GGUF's own chat template, as llama.cpp's chat API renders it."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata["tokenizer.chat_template"]
    eos = llm.detokenize([llm.token_eos()]).decode()
    formatter = Jinja2ChatFormatter(template, eos_token=eos, bos_token="")
    return formatter(messages=task_messages(task)).prompt


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=192, help="output tokens per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", type=Path, default=Path("/tmp/precast-speculative-engines"), help="built once, reused")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--skip-precast", action="store_true", help="only llama.cpp and the 32-way run")
    parser.add_argument("--llamacpp-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llamacpp_worker:
        return _llamacpp_worker(args.llamacpp_worker)

    from precast.packaged import packaged_model_path

    engines = build_engines(args.engines)
    rows = [] if args.skip_precast else bench_precast(engines, args.tokens, args.repeats, args.threads)
    if not args.skip_llamacpp:
        rows += bench_llamacpp(packaged_model_path(TARGET), args.tokens, args.repeats, args.threads)
    batch = None if args.skip_batch else bench_batch(engines["1.5b-bf16"], args.threads, 64)

    print(f"\n{cpu_name()}, {args.threads} threads; Qwen2.5-Coder-1.5B-Instruct, greedy, {args.tokens} output tokens, "
          f"decode tok/s after the first token, median ({args.repeats} runs: min..max)\n")  # fmt: skip
    print("| engine | proposer | task | decode tok/s | acceptance | speedup |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"| {r['engine']} | {r['proposer']} | {r['task']} | {cell(r['rates'])} | {acc} | {r['speedup']:.2f}x |")
    if batch:
        print(f"\n32 concurrent requests x 64 tokens, bf16: plain {batch['plain']:.1f} tok/s, with n-gram speculation "
              f"{batch['ngram']:.1f} tok/s ({batch['ngram'] / batch['plain']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
