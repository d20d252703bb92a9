"""precast.runtime: loads engine directories and runs them (LLM API, backends, tokenizer)."""

from precast.runtime.llm import LLM, RequestOutput
from precast.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
