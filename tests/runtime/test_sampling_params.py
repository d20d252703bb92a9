"""One schema for sampling parameters: every surface is made from SamplingParams' knobs."""

from __future__ import annotations

import argparse

import pytest

from precast.cli import _add_sampling_arguments, _sampling_from
from precast.errors import PrecastError
from precast.runtime.sampling_params import SamplingParams, field_type, knobs
from precast.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from precast.runtime.triton.repo import INPUTS


def test_every_surface_carries_the_fields_the_schema_gives_it():
    for f, k in knobs().items():
        for body in (CompletionRequest, ChatCompletionRequest):
            assert (f.name in body.model_fields) == k.openai or f.name in ("max_tokens", "logprobs"), (f.name, body)
        triton_inputs = {name for name, _, _ in INPUTS}
        assert all(n in triton_inputs for n in k.triton_names or ((f.name,) if k.triton else ()))
    parser = argparse.ArgumentParser()
    _add_sampling_arguments(parser, max_tokens=7)
    args = parser.parse_args(["--temperature", "0.5", "--stop", "a", "--stop", "b", "--ignore-eos"])
    assert {n for n in vars(args) if not n.startswith("_default_")} == {"temperature", "stop", "ignore_eos"}
    every = parser.parse_args([f"--{f.name.replace('_', '-')}" if field_type(f) == "bool" else f"--{f.name.replace('_', '-')}=1"
                               for f, k in knobs().items() if k.cli])  # fmt: skip
    assert {n for n in vars(every) if not n.startswith("_default_")} == {f.name for f, k in knobs().items() if k.cli}


def test_run_flags_then_engine_defaults_then_command_defaults():
    parser = argparse.ArgumentParser()
    _add_sampling_arguments(parser, max_tokens=7, temperature=0.0)
    args = parser.parse_args(["--temperature", "0.5", "--stop", "a", "--stop", "b", "--ignore-eos"])
    params = _sampling_from(args, {"temperature": 0.9, "top_p": 0.8, "repetition_penalty": 1.1})
    assert params.temperature == 0.5 and params.stop == ["a", "b"] and params.ignore_eos  # given
    assert params.top_p == 0.8 and params.repetition_penalty == 1.1  # the engine's
    assert params.max_tokens == 7 and params.top_k == 0  # the command's, the schema's
    assert _sampling_from(parser.parse_args([]), {"do_sample": False, "temperature": 0.7}).temperature == 0.0
    assert _sampling_from(parser.parse_args([]), {"max_new_tokens": 99}).max_tokens == 99


def test_openai_body_translates_every_field():
    body = CompletionRequest(model="m", prompt="hi", temperature=0.3, top_k=5, stop="x", seed=9, bad_words=["no"], min_tokens=2,
                             stop_token_ids=[7], skip_special_tokens=False, priority=3)  # fmt: skip
    params = body.sampling(12, 1, index=2, defaults={"top_p": 0.5, "temperature": 0.9})  # temperature given
    assert params == SamplingParams(max_tokens=12, temperature=0.3, top_p=0.5, top_k=5, stop=["x"], seed=11, bad_words=["no"], min_tokens=2,
                                    stop_token_ids=[7], skip_special_tokens=False, priority=3, logprobs=1)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=1.5), "top_k must be an integer >= 0"),
        (dict(min_p=float("nan")), r"min_p must be in \[0, 1\]"),
        (dict(seed=2**64), r"seed must be an integer in \[0, 2\*\*64\)"),
        (dict(stop=[""]), "stop must be a list of non-empty strings"),
        (dict(stop_token_ids=["3"]), "stop_token_ids must be a list of integers"),
        (dict(ignore_eos="yes"), "ignore_eos must be true or false"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens must be between 0 and max_tokens"),
    ],
)
def test_bounds_are_checked_once_with_one_message_each(kwargs, message):
    with pytest.raises(PrecastError, match="invalid sampling parameter: " + message):
        SamplingParams(**kwargs).validate()


def test_to_request_fills_the_cpp_request():
    req = SamplingParams(max_tokens=5, temperature=0.2, top_p=0.9, seed=4, logprobs=2, stop=["."], priority=1).to_request(
        [1, 2], False, [[3]]
    )
    assert req.prompt == [1, 2] and req.max_tokens == 5 and req.streaming and req.priority == 1 and req.bad_words == [[3]]
    assert req.sampling.temperature == pytest.approx(0.2) and req.sampling.seed == 4 and req.sampling.top_logprobs == 2
