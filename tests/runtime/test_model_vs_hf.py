"""The CPU runner against HF transformers: greedy tokens and log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from precast.runtime import LLM, SamplingParams
from tests.conftest import TINY_CONFIGS


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """HF greedy continuation and the log-softmax of its first step."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    first = torch.log_softmax(out.scores[0][0].float(), dim=-1).numpy()
    return out.sequences[0, len(prompt_ids) :].tolist(), first


def check_first_step_logprobs(ours, hf_logprobs: np.ndarray) -> None:
    """Our top-20 log-probs of the first step equal HF's for the same tokens."""
    top = ours.top_logprobs[0]
    ids = [t for t, _ in top]
    np.testing.assert_allclose([lp for _, lp in top], hf_logprobs[ids], atol=2e-4)
    assert ids[0] == int(np.argmax(hf_logprobs))


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_tiny_models_greedy_match_hf(name, tiny_checkpoints, tiny_engines):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[name], dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    vocab = TINY_CONFIGS[name][1]["vocab_size"]
    # Prompts longer than the sliding windows (8 and 16 tokens) and shorter ones.
    prompts = [rng.integers(0, vocab, n).tolist() for n in (1, 7, 23, 41)]
    with LLM(tiny_engines[name], kv_cache_memory=64 << 20) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=20))
    for prompt, ours in zip(prompts, outs):
        want, first = hf_greedy(model, prompt, 64)
        assert ours.token_ids == want, f"{name}, prompt of {len(prompt)} tokens"
        check_first_step_logprobs(ours, first)


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the ocean.",
    "Explain what a neural network is in two sentences.",
    "List three fruits.",
]


def test_smollm2_fp32_greedy_matches_hf(smollm2_engine, smollm2_hf_model):
    with LLM(smollm2_engine, kv_cache_memory=1 << 30) as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=20))
        assert outs[0].text.startswith("The capital of France is Paris.")
    for prompt, ours in zip(prompts, outs):
        want, first = hf_greedy(smollm2_hf_model, prompt, 64)
        assert ours.token_ids == want
        check_first_step_logprobs(ours, first)


def teacher_forced_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1 under an HF model."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def test_smollm2_bf16_is_close(smollm2_bf16_engine, smollm2_hf_model):
    """A bf16 engine holds bf16 weights. Where the CPU has bf16 dot-product units (AMX, AVX512-BF16;
    plugins/cpu/bf16_gemm.h) its linear layers multiply bf16-rounded activations by them into float32 and
    it attends over a bf16 KV cache on them, as HF transformers' bf16 model does; elsewhere it computes in
    float32. The oracle is HF in float32 on the same bf16-rounded weights. In float32: the same 32 greedy
    tokens and equal log-probs (2e-4). On a dot-product unit: the same first greedy token, first-step
    top-5 log-probs within 0.1, and along the oracle's 32 greedy tokens (teacher-forced, so one near-tie
    cannot send the texts apart) every token's log-prob within 0.15 (measured <= 0.05 on AMX and
    AVX512-BF16) and on average at least as close to the oracle as HF's own bf16 model (measured
    0.005-0.012 against its 0.020-0.029)."""
    import copy

    from precast import _C

    rounded = copy.deepcopy(smollm2_hf_model)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.bfloat16).float())
    hf_bf16 = copy.deepcopy(smollm2_hf_model).to(torch.bfloat16)
    on_unit = _C.dot_unit() != "float32"
    with LLM(smollm2_bf16_engine, kv_cache_memory=1 << 30) as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:2]]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20))
        assert outs[0].text.startswith("The capital of France is Paris.")
        oracle_paths = [prompt + hf_greedy(rounded, prompt, 32)[0] for prompt in prompts]
        forced = llm.generate(oracle_paths, SamplingParams(max_tokens=1, prompt_logprobs=0)) if on_unit else []
    for i, (prompt, ours) in enumerate(zip(prompts, outs)):
        want, first = hf_greedy(rounded, prompt, 32)
        ids = [t for t, _ in ours.top_logprobs[0]]
        our_lp = np.array([lp for _, lp in ours.top_logprobs[0]])
        if not on_unit:
            assert ours.token_ids == want
            check_first_step_logprobs(ours, first)
        else:
            assert ids[0] == int(np.argmax(first))
            assert np.abs(our_lp[:5] - first[ids[:5]]).max() < 0.1
            _, bf16_first = hf_greedy(hf_bf16, prompt, 1)
            assert np.abs(our_lp - first[ids]).max() <= np.abs(bf16_first[ids] - first[ids]).max()
            path = oracle_paths[i]
            oracle = teacher_forced_logprobs(rounded, path)[len(prompt) - 1 :]
            theirs = teacher_forced_logprobs(hf_bf16, path)[len(prompt) - 1 :]
            mine = np.array(forced[i].prompt_logprobs[len(prompt) :], dtype=float)
            assert np.abs(mine - oracle).max() < 0.15
            assert np.abs(mine - oracle).mean() <= np.abs(theirs - oracle).mean()
        _, fp32_first = hf_greedy(smollm2_hf_model, prompt, 1)
        assert np.abs(our_lp[:5] - fp32_first[ids[:5]]).max() < 0.1


def test_float16_engine_matches_hf_on_the_same_weights(tiny_checkpoints, tmp_path):
    """float16 storage, float32 compute: equal to HF in float32 on float16-rounded weights."""
    from transformers import AutoModelForCausalLM

    from precast.builder.build import BuildOptions, build_engine

    build_engine(BuildOptions(tiny_checkpoints["qwen3"], tmp_path / "e", dtype="float16", max_seq_len=256, progress=False))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen3"], dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    prompt = list(range(3, 30))
    with LLM(tmp_path / "e", kv_cache_memory=16 << 20) as llm:
        ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20))
    want, first = hf_greedy(model, prompt, 32)
    assert ours.token_ids == want
    check_first_step_logprobs(ours, first)


# mistral: a sliding window on every layer, GQA; gemma2: soft-capped scores in windowed and global layers; gemma3:
# sliding and global layers rotating with different RoPE tables.
@pytest.mark.parametrize("name,tokens_per_block", [("mistral", 1), ("mistral", 4), ("mistral", 16), ("gemma2", 4), ("gemma3", 1)])
def test_small_kv_blocks_and_chunked_prefill_match_hf_exactly(name, tokens_per_block, tiny_checkpoints, tmp_path):
    """Attention tiles keys per cache block and queries per prefill chunk; neither may change a result:
    the same log-probabilities as one roomy prefill, bit for bit, and HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from precast.builder.build import BuildOptions, build_engine

    build_engine(
        BuildOptions(
            tiny_checkpoints[name],
            tmp_path / "e",
            max_seq_len=256,
            tokens_per_block=tokens_per_block,
            max_num_tokens=64,
            max_batch_size=8,
            progress=False,
        )
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[name], dtype=torch.float32).eval()
    prompt = np.random.default_rng(3).integers(0, TINY_CONFIGS[name][1]["vocab_size"], 45).tolist()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    with LLM(tmp_path / "e", kv_cache_memory=16 << 20) as roomy:
        whole = roomy.generate(prompt, params)
    with LLM(tmp_path / "e", kv_cache_memory=16 << 20, max_num_tokens=10) as chunked:  # prompt in 5 chunks
        pieces = chunked.generate(prompt, params)
    # HF without a cache (a full forward per token): its generate() with a sliding-window cache picks other
    # tokens once a prompt is well past the window (transformers 5.24), while its uncached forward agrees with us.
    want = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            want.append(int(model(torch.tensor([want])).logits[0, -1].argmax()))
    assert pieces.token_ids == whole.token_ids == want[len(prompt) :]
    assert pieces.top_logprobs == whole.top_logprobs


@pytest.mark.parametrize("name", ["phi3", "phi4mini"])
def test_longrope_engine_for_long_sequences_uses_the_long_factors(name, tiny_checkpoints, tmp_path):
    """An engine whose max_seq_len exceeds the original context rotates with the long factors, as transformers does
    for a sequence longer than that context (300 > 256 tokens here); partial rotary (phi4mini) included."""
    from transformers import AutoModelForCausalLM

    from precast.builder.build import BuildOptions, build_engine
    from precast.engine.directory import load_engine
    from precast.runtime.cpu_backend import make_cpu_runner

    build_engine(BuildOptions(tiny_checkpoints[name], tmp_path / "e", max_seq_len=512, progress=False))
    prompt = np.random.default_rng(5).integers(0, TINY_CONFIGS[name][1]["vocab_size"], 300).tolist()
    ours = make_cpu_runner(load_engine(tmp_path / "e"), num_threads=2).evaluate(prompt, True)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[name], dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4 * np.abs(theirs).max())


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_prompt_logprobs_match_hf_in_chunks_and_beside_other_requests(name, tiny_checkpoints, tiny_engines):
    """Every prompt token's log-probability (and the top 3) equals HF's log-softmax at the position before it,
    whether the prompt runs in one step or in chunks of 8, alone or batched; a repeated prompt is recomputed
    rather than served from the prefix cache, so it is scored again."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[name], dtype=torch.float32).eval()
    prompt = np.random.default_rng(2).integers(0, TINY_CONFIGS[name][1]["vocab_size"], 70).tolist()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1).numpy()
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    other = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for max_num_tokens in (None, 8):
        with LLM(tiny_engines[name], kv_cache_memory=64 << 20, max_num_tokens=max_num_tokens) as llm:
            outs = llm.generate([prompt, prompt[:30], prompt], [scored, other, scored])
        for out in (outs[0], outs[2]):
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            np.testing.assert_allclose(out.prompt_logprobs[1:], want[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-4)
            for p, top in enumerate(out.prompt_top_logprobs[1:]):
                assert [t for t, _ in top] == list(np.argsort(-want[p], kind="stable")[:3])
            assert out.num_cached_tokens == 0
        assert outs[1].prompt_logprobs == []


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_mixture_of_experts_is_batch_invariant(name, tiny_engines):
    """Experts run once per step over every token routed to them; a request's log-probabilities are bit for bit the
    same alone and in a batch whose other requests send tokens to the same experts, with chunked prefill."""
    rng = np.random.default_rng(4)
    vocab = TINY_CONFIGS[name][1]["vocab_size"]
    prompt = rng.integers(0, vocab, 30).tolist()
    others = [rng.integers(0, vocab, n).tolist() for n in (5, 17, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    with LLM(tiny_engines[name], kv_cache_memory=64 << 20) as llm:
        alone = llm.generate(prompt, params)
        batched = llm.generate([others[0], prompt, *others[1:]], params)[1]
    with LLM(tiny_engines[name], kv_cache_memory=64 << 20, max_num_tokens=12) as chunked:
        pieces = chunked.generate([prompt, *others], params)[0]
    assert alone.token_ids == batched.token_ids == pieces.token_ids
    assert alone.top_logprobs == batched.top_logprobs == pieces.top_logprobs


def test_gemma3_image_text_checkpoint_builds_its_text_decoder(tmp_path):
    """Gemma3ForConditionalGeneration (Gemma 3 4B and up): the decoder under language_model is built, the vision
    tower and projector left out, and text generation matches transformers' image-text model given text only, from
    the hub's file layout and from the in-memory one with a sparse text_config."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from precast.builder.build import BuildOptions, build_engine

    text = dict(TINY_CONFIGS["gemma3"][1], tie_word_embeddings=True)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=127, boi_token_index=125, eoi_token_index=126
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    ckpt = tmp_path / "gemma3-it"
    model.save_pretrained(ckpt)  # the hub's layout: language_model.model.*, vision_tower.*, multi_modal_projector.*
    assert any(k.startswith("language_model.model.") for k in load_file(ckpt / "model.safetensors"))

    # The layout of transformers' in-memory model (model.language_model.*, ...), as some exports write it, with a
    # text_config that lists only what differs from Gemma3TextConfig's defaults, as the hub's configs do.
    other = tmp_path / "gemma3-other"
    other.mkdir()
    renames = (
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
    tensors = {}
    for name, value in load_file(ckpt / "model.safetensors").items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
        tensors[name] = value
    save_file(tensors, other / "model.safetensors")
    saved = json.loads((ckpt / "config.json").read_text())
    defaults = {"rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "final_logit_softcapping": None}
    sparse = {k: v for k, v in saved["text_config"].items() if k not in defaults or v != defaults[k]}
    assert len(sparse) < len(saved["text_config"])
    (other / "config.json").write_text(json.dumps(dict(saved, text_config=sparse)))

    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 120, n).tolist() for n in (3, 19, 30)]
    for source in (ckpt, other):
        engine = tmp_path / f"engine-{source.name}"
        build_engine(BuildOptions(source, engine, max_seq_len=256, progress=False))
        with LLM(engine, kv_cache_memory=64 << 20) as llm:
            assert llm.engine.config.model.architecture == "gemma3"
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20))
        for prompt, ours in zip(prompts, outs):
            want, first = hf_greedy(model, prompt, 12)
            assert ours.token_ids == want, (source.name, len(prompt))
            check_first_step_logprobs(ours, first)
