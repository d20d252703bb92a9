"""Rebuild a `tokenizers` tokenizer.json (and tokenizer_config.json) from GGUF metadata.

A GGUF stores the vocabulary, merges, token types and special ids, plus the name of the
pre-tokenizer (`tokenizer.ggml.pre`), which fixes how text is split before BPE. Two kinds are rebuilt:
- byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Llama 3, Qwen 2/3); the split rule for each
  known pre-tokenizer name is the one its original tokenizer.json uses;
- SentencePiece BPE (`"llama"`: Llama 2 and Mistral v1 exports, architecture llama): pieces spelled with "▁" for
  spaces, byte fallback through the `<0x..>` tokens, merges from the file or, as llama.cpp's exports usually have
  none, implied by the vocabulary and its scores (every split of a piece into two pieces, best-scored piece first).
  Gemma's variant (architectures gemma2, gemma3) differs in three ways the file does not state: spaces become "▁"
  by a normalizer with no prefix space, pieces made only of spaces are stored as spaces (spelled "▁" here), and
  the implied merges follow the pieces' order in the file, not their scores. Phi-3's variant is refused.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from precast.builder.checkpoint.base import TokenizerFiles
from precast.errors import PrecastError

# Split rules of the original tokenizers (Llama 3 and Qwen 2 regexes; SmolLM splits digits one by one).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(add_prefix_space: bool = False) -> pre_tokenizers.PreTokenizer:
    """GPT-2's own split regex, then bytes to the byte-level alphabet."""
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


PRE_TOKENIZERS = {
    "default": _byte_level,
    "gpt-2": _byte_level,
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}

# llama.cpp token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level_bpe(
    metadata: dict[str, Any], tokens: list[str], merges: list[tuple[str, ...]], source: str
) -> tuple[Tokenizer, dict[str, int]]:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise PrecastError(
            f"{source}: pre-tokenizer {pre!r} is unknown to precast (known: {', '.join(sorted(PRE_TOKENIZERS))}); "
            "splitting text another way would silently change tokenization, so the build stops"
        )
    # Tokens are stored in the byte-level alphabet already; one that is not (a raw space
    # in an added token, say) is respelled so that BPE can ever produce it.
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def _sentencepiece_bpe(
    metadata: dict[str, Any], tokens: list[str], merges: list[tuple[str, ...]], source: str
) -> tuple[Tokenizer, dict[str, int]]:
    arch = metadata.get("general.architecture")
    if arch not in _SENTENCEPIECE_ARCHITECTURES:
        raise PrecastError(
            f"{source}: a SentencePiece tokenizer for architecture {arch!r} is not rebuilt (its variant is not stated in "
            f"the file; precast knows {', '.join(_SENTENCEPIECE_ARCHITECTURES)}); build from the HF checkpoint, which "
            "carries tokenizer.json"
        )
    gemma = arch in _GEMMA
    if gemma:
        tokens = [_gemma_spelling(t) for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if not merges:
        scores = list(metadata.get("tokenizer.ggml.scores") or [])
        if gemma:  # Gemma's scores do not rank its merges; the file's order does
            scores = [-float(i) for i in range(len(tokens))]
        if len(scores) != len(tokens):
            raise PrecastError(f"{source}: a SentencePiece vocabulary of {len(tokens)} tokens needs as many scores, got {len(scores)}")
        merges = _merges_implied(vocab, dict(zip(tokens, scores)))
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok, vocab
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))  # a space before the text's first word
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok, vocab


_GEMMA = ("gemma2", "gemma3")
_SENTENCEPIECE_ARCHITECTURES = ("llama", *_GEMMA)


def _gemma_spelling(token: str) -> str:
    """llama.cpp writes Gemma's pieces of two or more spaces as spaces; the vocabulary spells them with "▁"."""
    return "\u2581" * len(token) if len(token) > 1 and not token.strip(" ") else token


def _merges_implied(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces of the vocabulary,
    ordered by the piece's score (best first), then by the lengths of the two parts (longer first); a piece's own
    splits in the order of their parts' ids."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        splits = [(piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def tokenizer_from_gguf(metadata: dict[str, Any], source: str) -> TokenizerFiles:
    kind = metadata.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise PrecastError(
            f"{source}: tokenizer type {kind!r} is not supported yet (precast rebuilds byte-level BPE, 'gpt2', and "
            "SentencePiece BPE, 'llama', tokenizers from GGUF); build from the HF checkpoint, which carries tokenizer.json"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    if len(token_types) != len(tokens):
        raise PrecastError(f"{source}: {len(tokens)} tokens but {len(token_types)} token types; the file is corrupt")
    tok, vocab = builders[kind](metadata, tokens, merges, source)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types) if ty == _CONTROL])
    # Only pieces of the vocabulary as spelled (a Gemma piece of spaces, respelled, is matched by BPE, not as added text).
    user_defined = [t for t, ty in zip(tokens, token_types) if ty == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    def token(key: str) -> str | None:
        idx = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos) or (add_eos and eos):
        single = " ".join([f"{bos}:0"] * (add_bos and bos is not None) + ["$A:0"] + [f"{eos}:0"] * (add_eos and eos is not None))
        pair = single + " " + single.replace("$A", "$B").replace(":0", ":1")
        special = [(t, vocab[t]) for t in (bos if add_bos else None, eos if add_eos else None) if t]
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    chat_template = metadata.get("tokenizer.chat_template")
    arch = metadata.get("general.architecture", "")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": metadata.get(f"{arch}.context_length"),
        "chat_template": chat_template,
    }
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    return TokenizerFiles(
        files={
            "tokenizer.json": tok.to_str().encode("utf-8"),
            "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False).encode("utf-8"),
        },
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos_id is None else [eos_id],
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        chat_template=chat_template,
    )
