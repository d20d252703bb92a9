"""lm-evaluation-harness against `precast serve`: `local-completions` on two tasks whose data lives here (a
log-likelihood task through echo + logprobs, a generate-until task), offline; its log-likelihoods equal precast's own
prompt log-probabilities."""

from __future__ import annotations

import json

import lm_eval
import pytest

from precast.runtime import LLM, SamplingParams
from tests.runtime.test_server import MODEL, start_server, stop_server

QUESTIONS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": ["green", "blue", "red"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "answer": 0},
]
LOGLIKELIHOOD_TASK = """task: precast_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GENERATE_TASK = """task: precast_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}?\\nA:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (root / "loglikelihood.yaml").write_text(LOGLIKELIHOOD_TASK.format(data=data))
    (root / "generate.yaml").write_text(GENERATE_TASK.format(data=data))
    return root


def test_local_completions_loglikelihood_and_generation(smollm2_bf16_engine, tasks, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc, base = start_server(smollm2_bf16_engine)
    try:
        model_args = (
            f"model={MODEL},base_url={base}/v1/completions,tokenizer={smollm2_bf16_engine},tokenizer_backend=huggingface,"
            "num_concurrent=2,max_retries=1,timeout=120"
        )
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=["precast_loglikelihood", "precast_generate"],
            task_manager=TaskManager(include_path=str(tasks)),
            log_samples=True,
            random_seed=0,
        )
    finally:
        stop_server(proc)
    assert results["results"]["precast_loglikelihood"]["acc,none"] >= 0.5
    generated = results["samples"]["precast_generate"]
    assert len(generated) == len(QUESTIONS) and all(isinstance(s["resps"][0][0], str) for s in generated)

    # Each choice's log-likelihood equals precast's own sum of the continuation's prompt log-probabilities.
    with LLM(smollm2_bf16_engine, kv_cache_memory=256 << 20) as llm:
        for sample in results["samples"]["precast_loglikelihood"]:
            for (context, continuation), [(loglikelihood, _)] in zip(sample["arguments"], sample["resps"]):
                context_ids = llm.tokenize(context, add_special_tokens=False)
                whole = llm.tokenize(context + continuation, add_special_tokens=False)
                assert whole[: len(context_ids)] == context_ids
                out = llm.generate(whole, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
                ours = sum(out.prompt_logprobs[len(context_ids) :])
                assert abs(ours - loglikelihood) < 1e-4, (context, continuation, ours, loglikelihood)
