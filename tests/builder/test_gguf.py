"""GGUF reading, checked against transformers' own GGUF loader (the oracle)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from precast.builder.build import BuildOptions, build_engine
from precast.builder.checkpoint import open_checkpoint
from precast.engine.directory import load_engine
from tests.builder.gguf_fixtures import write_moe_gguf_from_hf, write_phi3_gguf_from_hf, write_tiny_gemma_gguf, write_tiny_llama_gguf

QUANT_MIX = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q6_K",
    "attn_q.weight": "Q4_K",
    "attn_k.weight": "Q4_0",
    "attn_v.weight": "Q5_0",
    "attn_output.weight": "Q4_1",
    "ffn_gate.weight": "F16",
    "ffn_up.weight": "BF16",
    "ffn_down.weight": "Q4_K",
}


def test_every_required_quant_type_matches_transformers(tmp_path):
    """Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, F16, BF16, F32 dequantized, Q/K unpermuted with GQA."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, QUANT_MIX)
    ckpt = open_checkpoint(path)
    assert {ckpt.tensor_dtype(n) for n in ckpt.tensor_names()} == {"Q8_0", "Q6_K", "Q4_K", "Q4_0", "Q4_1", "Q5_0", "F16", "BF16", "F32"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    state = model.state_dict()
    assert set(ckpt.tensor_names()) == set(state)
    for name in ckpt.tensor_names():
        ours = ckpt.read(name)
        assert ours.shape == tuple(state[name].shape), name
        np.testing.assert_allclose(ours, state[name].numpy(), rtol=1e-6, atol=1e-7, err_msg=f"{name} ({ckpt.tensor_dtype(name)})")


def test_layout_reader_matches_the_gguf_package(tmp_path):
    """precast's fast header reader (gguf_layout.py) sees what gguf.GGUFReader sees: every key, value and tensor."""
    import gguf

    from precast.builder.checkpoint.gguf_layout import read_gguf_layout

    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, QUANT_MIX)
    ours, theirs = read_gguf_layout(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected and ours.version == 3
    assert [(t.name, t.shape, t.tensor_type) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type) for t in theirs.tensors
    ]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name


def test_tied_gguf_has_no_lm_head(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_llama_gguf(path, {}, tied=True)
    build_engine(BuildOptions(path, tmp_path / "e", progress=False))
    engine = load_engine(tmp_path / "e")
    assert engine.config.model.tie_word_embeddings and "lm_head.weight" not in engine.weights.tensors


def test_smollm2_tensors_match_transformers(smollm2_gguf, smollm2_hf_model):
    ckpt = open_checkpoint(smollm2_gguf)
    state = smollm2_hf_model.state_dict()
    names = set(ckpt.tensor_names())
    # transformers materializes the tied head as its own entry; the GGUF (and precast) do not.
    assert names == set(state) - {"lm_head.weight"}
    for name in sorted(names):
        np.testing.assert_array_equal(ckpt.read(name), state[name].numpy(), err_msg=name)


def test_smollm2_gguf_builds_the_same_engine_as_its_hf_checkpoint(smollm2_gguf, smollm2_hf_dir, tmp_path):
    build_engine(BuildOptions(smollm2_gguf, tmp_path / "from-gguf", progress=False))
    build_engine(BuildOptions(smollm2_hf_dir, tmp_path / "from-hf", dtype="float32", progress=False))
    a, b = load_engine(tmp_path / "from-gguf"), load_engine(tmp_path / "from-hf")
    assert a.config.model == b.config.model
    assert a.config.limits == b.config.limits and a.config.dtype == b.config.dtype == "float32"
    assert a.weights.tensors.keys() == b.weights.tensors.keys()
    for name in a.weights.tensors:
        np.testing.assert_array_equal(a.weights.read(name), b.weights.read(name), err_msg=name)
    ta, tb = a.config.tokenizer, b.config.tokenizer
    for key in ("bos_token_id", "eos_token_ids", "chat_template"):
        assert ta[key] == tb[key], key
    assert a.config.provenance["source_format"] == "gguf" and b.config.provenance["source_format"] == "hf"


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_gguf_builds_the_same_engine_as_its_hf_checkpoint(name, tiny_checkpoints, tmp_path):
    """llama.cpp's mixture-of-experts layout (stacked experts, ffn_gate_inp router, Qwen2-MoE's shared expert and its
    vector gate, Mixtral as `llama` with permuted Q/K, Qwen's dense layers without a router) gives the engine the HF
    checkpoint gives: the same spec and the same tensors, bit for bit."""
    path = tmp_path / f"{name}.gguf"
    write_moe_gguf_from_hf(tiny_checkpoints[name], path)
    build_engine(BuildOptions(path, tmp_path / "from-gguf", dtype="float32", max_seq_len=128, progress=False))
    build_engine(BuildOptions(tiny_checkpoints[name], tmp_path / "from-hf", dtype="float32", max_seq_len=128, progress=False))
    a, b = load_engine(tmp_path / "from-gguf"), load_engine(tmp_path / "from-hf")
    spec = a.config.model
    assert np.float32(spec.norm_eps) == np.float32(b.config.model.norm_eps)  # GGUF keeps it as float32
    assert dataclasses.replace(spec, norm_eps=b.config.model.norm_eps) == b.config.model and spec.num_experts > 0
    assert a.weights.tensors.keys() == b.weights.tensors.keys()
    for tensor in a.weights.tensors:
        np.testing.assert_array_equal(a.weights.read(tensor), b.weights.read(tensor), err_msg=tensor)


@pytest.mark.parametrize("name", ["phi3", "phi4mini"])
def test_phi3_gguf_builds_the_same_engine_as_its_hf_checkpoint(name, tiny_checkpoints, tmp_path):
    """llama.cpp's phi3 layout (fused qkv and gate|up, a sliding window, partial rotary as rope.dimension_count,
    LongRoPE's factors as tensors) gives the HF checkpoint's engine: the same tensors bit for bit, the same spec but for
    what GGUF keeps in float32 (eps, the LongRoPE factors), the same RoPE frequencies to float32 precision."""
    from precast.engine.rope import rope_parameters

    path = tmp_path / f"{name}.gguf"
    write_phi3_gguf_from_hf(tiny_checkpoints[name], path)
    build_engine(BuildOptions(path, tmp_path / "from-gguf", dtype="float32", max_seq_len=1024, progress=False))
    build_engine(BuildOptions(tiny_checkpoints[name], tmp_path / "from-hf", dtype="float32", max_seq_len=1024, progress=False))
    a, b = load_engine(tmp_path / "from-gguf"), load_engine(tmp_path / "from-hf")
    ours, theirs = a.config.model, b.config.model
    assert ours.rope_scaling.rope_type == "longrope" and ours.rotary_dim == theirs.rotary_dim
    assert dataclasses.replace(ours, norm_eps=theirs.norm_eps, rope_scaling=theirs.rope_scaling) == theirs
    for max_seq_len in (1024, 200):  # the long factors, and the short ones (within the original 256 positions)
        for a_part, b_part in zip(rope_parameters(ours, max_seq_len), rope_parameters(theirs, max_seq_len)):
            np.testing.assert_allclose(a_part, b_part, rtol=1e-6)
    assert a.weights.tensors.keys() == b.weights.tensors.keys()
    for tensor in a.weights.tensors:
        np.testing.assert_array_equal(a.weights.read(tensor), b.weights.read(tensor), err_msg=tensor)


def test_quantized_stacked_experts_are_read_one_expert_at_a_time(tiny_checkpoints, tmp_path):
    """Each expert of a Q8_0 stack is its own rows' blocks, dequantized alone: what dequantizing the whole stack
    gives for that expert."""
    import gguf
    from gguf.quants import dequantize

    from precast.builder.checkpoint.gguf_layout import read_gguf_layout

    path = tmp_path / "qwen3_moe.gguf"
    write_moe_gguf_from_hf(tiny_checkpoints["qwen3_moe"], path, expert_type="Q8_0")
    ckpt = open_checkpoint(path)
    stack = next(t for t in read_gguf_layout(path).tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert stack.tensor_type == gguf.GGMLQuantizationType.Q8_0
    whole = dequantize(np.asarray(stack.data), stack.tensor_type).reshape(tuple(reversed(stack.shape)))
    for e in (0, 7, 15):
        np.testing.assert_array_equal(ckpt.read(f"model.layers.1.mlp.experts.{e}.down_proj.weight"), whole[e])
    assert ckpt.tensor_shape("model.layers.1.mlp.experts.15.down_proj.weight") == (64, 32)


def test_moe_gguf_with_another_routing_rule_is_refused(tiny_checkpoints, tmp_path):
    import gguf

    from precast.builder.checkpoint.gguf_layout import read_gguf_layout
    from precast.errors import PrecastError

    path = tmp_path / "qwen3_moe.gguf"
    write_moe_gguf_from_hf(tiny_checkpoints["qwen3_moe"], path)
    layout = read_gguf_layout(path)
    sigmoid = tmp_path / "sigmoid.gguf"
    w = gguf.GGUFWriter(sigmoid, "qwen3moe")
    for key, value in layout.metadata.items():
        if key.startswith("qwen3moe.") and isinstance(value, int):
            w.add_uint32(key, value)
        elif key.startswith("qwen3moe.") and isinstance(value, float):
            w.add_float32(key, value)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    for t in layout.tensors:
        w.add_tensor(t.name, np.asarray(t.data).view(np.float32).reshape(tuple(reversed(t.shape))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(PrecastError, match="gating function 2 \\(not softmax\\) is not supported"):
        open_checkpoint(sigmoid)


MULTILINGUAL = (
    "The quick brown fox jumps over the lazy dog. Ça va très bien, merci! Größe und Straße. "
    "東京は日本の首都です。 北京欢迎你。 Привет, как дела? مرحبا بالعالم. नमस्ते दुनिया. 🤖🚀✨ "
    "  two  spaces\ttab\nnew line, code: def f(x): return x**2 # comment\n"
    "<|im_start|>user\nHello<|im_end|>\n"
)


def test_smollm2_tokenizer_matches_transformers(smollm2_gguf, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    build_engine(BuildOptions(smollm2_gguf, tmp_path / "e", progress=False))
    engine = load_engine(tmp_path / "e")
    ours = Tokenizer.from_file(str(engine.tokenizer_path))
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ids = ours.encode(MULTILINGUAL).ids
    assert ids == theirs.encode(MULTILINGUAL, add_special_tokens=True)
    assert ours.encode("<|im_start|>").ids == [1]  # control tokens stay whole
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == MULTILINGUAL  # byte-level BPE is lossless
    # SmolLM's pre-tokenizer splits digits one by one, as llama.cpp's "smollm" rule does.
    assert [ours.id_to_token(i) for i in ours.encode("x 2024").ids] == ["x", "Ġ", "2", "0", "2", "4"]

    tok_config = json.loads((engine.path / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" or tok_config["eos_token"] == ours.id_to_token(2)
    assert tok_config["chat_template"] == engine.config.tokenizer["chat_template"]
    assert "<|im_start|>" in engine.config.tokenizer["chat_template"]
    # The chat template renders with the special tokens of this vocabulary.
    rendered = theirs.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in rendered


def _llama3_divisors(factor: float, low: float, high: float, original: int, theta: float = 10000.0, dim: int = 64) -> np.ndarray:
    """What llama.cpp writes as rope_freqs.weight for llama3 scaling, from transformers' own llama3 RoPE."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=4 * original,
        rope_parameters={"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                         "original_max_position_embeddings": original, "rope_theta": theta},
    )  # fmt: skip
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    return (plain / scaled.double().numpy()).astype(np.float32)


def test_rope_freqs_become_llama3_scaling(tmp_path):
    """llama.cpp stores llama3 RoPE scaling as per-frequency divisors; the build recovers the parameters, and the
    engine's inverse frequencies are transformers' llama3 ones."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from precast.engine.rope import rope_parameters

    for factor, low, high, original in ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (8.0, 2.0, 8.0, 8192)):
        path = tmp_path / f"llama3-{factor}-{low}-{high}.gguf"
        write_tiny_llama_gguf(path, {}, rope_freqs=_llama3_divisors(factor, low, high, original))
        build_engine(BuildOptions(path, tmp_path / path.stem, max_seq_len=128, progress=False))
        spec = load_engine(tmp_path / path.stem).config.model
        s = spec.rope_scaling
        assert s.rope_type == "llama3" and s.original_max_position_embeddings == original
        assert abs(s.factor - factor) < 1e-4 and abs(s.low_freq_factor - low) < 1e-3 and abs(s.high_freq_factor - high) < 1e-3
        config = LlamaConfig(
            hidden_size=256, num_attention_heads=4, max_position_embeddings=4 * original,
            rope_parameters={"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                             "original_max_position_embeddings": original, "rope_theta": 10000.0},
        )  # fmt: skip
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        np.testing.assert_allclose(rope_parameters(spec)[0], want.numpy(), rtol=2e-6)


def test_rope_freqs_that_follow_no_llama3_rule_are_refused(tmp_path):
    import pytest

    from precast.errors import PrecastError

    path = tmp_path / "odd.gguf"
    write_tiny_llama_gguf(path, {}, rope_freqs=np.random.default_rng(0).uniform(1.0, 5.0, 32))
    with pytest.raises(PrecastError, match="follow no llama3 scaling rule"):
        open_checkpoint(path)


SPM_TEXT = (
    "The quick brown fox jumps over the lazy dog. A sentencepiece vocabulary writes spaces as a lower one-eighth block; "
    "llama.cpp keeps it in the GGUF with a score per piece and no merges. Numbers like 12345 and 2026 appear too.\n"
) * 20


def sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary as llama.cpp exports one: <unk>, <s>, </s>, the 256 byte pieces, then
    pieces learned by BPE on SPM_TEXT, each scored by its rank (earlier merges score higher)."""
    from tokenizers import SentencePieceBPETokenizer

    learner = SentencePieceBPETokenizer()
    learner.train_from_iterator([SPM_TEXT], vocab_size=400, min_frequency=2, show_progress=False)
    learned = sorted(learner.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [t for t, _ in learned if t not in tokens]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, types


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    from precast.runtime.tokenizer import Tokenizer

    path = tmp_path / "spm.gguf"
    write_tiny_llama_gguf(path, {}, sentencepiece=sentencepiece_vocabulary())
    build_engine(BuildOptions(path, tmp_path / "engine", progress=False))
    ours = Tokenizer(load_engine(tmp_path / "engine"))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = [
        "The quick brown fox",
        " leading space and  two   spaces",
        "Numbers 12345, 2026!\nNew line\ttab",
        "unicode é ü 漢字 🙂 falls back to bytes",
        "lazy dog.lazy dog. llama.cpp",
        "",
    ]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hi")[0] == 1  # BOS added: llama.cpp's default for a SentencePiece vocabulary


def gemma_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A Gemma-style SentencePiece vocabulary as llama.cpp exports one: <pad>, <eos>, <bos>, <unk>, two turn markers,
    the byte pieces, pieces of 2 and 3 spaces stored as spaces (one of them user-defined), learned pieces; scores
    that do not follow the pieces' order (Gemma's merges follow the order)."""
    from tokenizers import SentencePieceBPETokenizer

    learner = SentencePieceBPETokenizer()
    learner.train_from_iterator([SPM_TEXT.replace(". ", ".  ")], vocab_size=420, min_frequency=2, show_progress=False)
    learned = [t for t, _ in sorted(learner.get_vocab().items(), key=lambda kv: kv[1]) if t.strip("\u2581") or len(t) == 1]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["  ", "   "] + [t for t in learned if t not in tokens]
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1, 4] + [1] * (len(tokens) - 264)
    scores = np.random.default_rng(1).uniform(-100, 0, len(tokens)).tolist()
    return tokens, scores, types


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_reads_and_runs_as_transformers_reads_it(arch, tmp_path):
    """llama.cpp's Gemma layout (four norms stored as 1 + w, no Q/K permutation, Gemma 3's local RoPE and linear
    scaling) becomes the model transformers makes of the file: same tensors, same logits, same tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from precast.runtime.cpu_backend import make_cpu_runner
    from precast.runtime.tokenizer import Tokenizer

    path = tmp_path / f"{arch}.gguf"
    write_tiny_gemma_gguf(path, arch, gemma_vocabulary())
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    if arch == "gemma3":  # transformers' GGUF config reading drops the file's rope.scaling (llama.cpp applies it)
        config.rope_parameters["full_attention"].update(rope_type="linear", factor=8.0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, config=config, dtype=torch.float32).eval()
    state = model.state_dict()
    ckpt = open_checkpoint(path)
    for name in ckpt.tensor_names():
        np.testing.assert_array_equal(ckpt.read(name), state[name].numpy(), err_msg=name)
    build_engine(BuildOptions(path, tmp_path / "engine", max_seq_len=64, progress=False))
    engine = load_engine(tmp_path / "engine")
    spec = engine.config.model
    assert spec.architecture == arch and spec.sandwich_norms and spec.activation == "gelu_tanh"
    if arch == "gemma3":
        assert spec.sliding_window_layers == (0, 1, 2, 3, 4) and spec.local_rope_theta == 10000.0 and spec.rope_scaling.factor == 8.0
    else:
        assert spec.attn_logit_softcap == 50.0 and spec.final_logit_softcap == 30.0
    prompt = np.random.default_rng(2).integers(0, spec.vocab_size, 20).tolist()
    ours = np.asarray(make_cpu_runner(engine, num_threads=2).evaluate(prompt, True)).reshape(len(prompt), -1)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(ours, want, atol=1e-4 * np.abs(want).max(), rtol=0)

    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tokenizer = Tokenizer(engine)
    for text in [
        "The quick brown fox.  Two spaces,   three,    four",
        "  leading spaces and a trailing one ",
        "<start_of_turn>user\nNumbers 12345<end_of_turn>\n",
        "unicode é 漢字 🙂 falls back to bytes",
        "",
    ]:
        assert tokenizer.encode(text) == theirs.encode(text), text
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert tokenizer.encode("hi")[0] == 2  # <bos>
