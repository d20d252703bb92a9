"""Streaming text is exactly the final text: multi-byte characters, spaces, stop strings."""

from __future__ import annotations

import pytest

from precast.engine.directory import load_engine
from precast.runtime import SamplingParams
from precast.runtime.detokenizer import IncrementalDetokenizer
from precast.runtime.tokenizer import Tokenizer

TEXTS = [
    "東京は日本の首都です。北京欢迎你！",
    "Emoji: 🤖🚀✨👍🏽 and family 👨‍👩‍👧 done",
    "  leading spaces,\ttabs\nand new lines  ",
    "Ünïcödé Größe — “quotes” … 한국어 텍스트",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_bf16_engine) -> Tokenizer:
    return Tokenizer(load_engine(smollm2_bf16_engine))


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Say:"), stop=[])
    deltas = [detok.add([t]) for t in ids[:-1]] + [detok.add([ids[-1]], final=True)]
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # never half a character
    if not text.isascii():  # characters split across tokens: the case incremental decoding exists for
        assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_stop_string_spanning_tokens(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    boundary = next(len(p) for p in pieces if len(p) >= len(text) // 2)
    stop = text[boundary - 2 : boundary + 2]
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    deltas = []
    for t in ids:
        deltas.append(detok.add([t]))
        if detok.stopped:
            break
    assert detok.stopped
    assert "".join(deltas) == detok.text == text[: text.find(stop)]


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [], stop=[])
    assert detok.add(ids[:1]) == ""  # half an emoji shows nothing yet
    assert detok.add([], final=True) != ""  # the end shows what the bytes decode to


def test_llm_stream_equals_generate(smollm2_llm):
    llm = smollm2_llm
    prompt = llm.apply_chat_template([{"role": "user", "content": "Translate 'good morning' into Japanese, Chinese and Korean."}])
    params = SamplingParams(temperature=0, max_tokens=60)
    final = llm.generate(prompt, params)
    streamed = list(llm.stream(prompt, params))
    assert "".join(o.delta for o in streamed) == final.text == streamed[-1].text
    assert streamed[-1].token_ids == final.token_ids
    assert any(ord(c) > 0x3000 for c in final.text)  # the model did write CJK

    # A stop string spanning tokens, taken from the text itself: output is the text before it.
    stop = final.text[len(final.text) // 2 - 2 : len(final.text) // 2 + 3]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, stop=[stop]))
    assert cut.text == final.text[: final.text.find(stop)] and cut.finish_reason == "stop"
    cut_stream = list(llm.stream(prompt, SamplingParams(temperature=0, max_tokens=60, stop=[stop])))
    assert "".join(o.delta for o in cut_stream) == cut.text and cut_stream[-1].finish_reason == "stop"


def test_async_api_serves_many_coroutines(smollm2_llm):
    import asyncio

    llm = smollm2_llm

    async def one(i: int) -> str:
        text = ""
        async for out in llm.generate_async(f"Number {i}:", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)):
            text += out.delta
        assert out.finished and out.text == text
        return text

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(12)))

    texts = asyncio.run(main())
    sync = llm.generate([f"Number {i}:" for i in range(12)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert texts == [o.text for o in sync]
