"""Tandem's runtime: requests, scheduling, KV blocks, the engine and its async loop.

Heavy modules import lazily so `from runtime import SamplingParams` stays cheap.
"""

from tandem.runtime.sampling_params import SamplingParams, SamplingParamsError

__all__ = ["LLM", "SamplingParams", "SamplingParamsError"]


def __getattr__(name: str):
    if name == "LLM":
        from tandem.runtime.llm import LLM

        return LLM
    raise AttributeError(name)
