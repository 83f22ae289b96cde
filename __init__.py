"""Tandem, an LLM inference server. The offline API: `from tandem import LLM, SamplingParams`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy, so `tandem --version` and the server's CLI do not pay for torch twice.
    if name == "LLM":
        from tandem.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tandem.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
