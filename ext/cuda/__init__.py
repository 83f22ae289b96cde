"""CUDA kernels (CuPy RawModules compiled from the `.cu` files here): paged-attention decode
and extend, DeepSeek's latent attention (MLA) and the KV-cache write, registered as
`torch.ops.tandem.*` custom ops.

Importing this package needs neither CuPy nor CUDA; calling a kernel needs both
(`is_available()` says whether they are there). References: ext/attention_ref.py, ext/mla_ref.py.
"""

from __future__ import annotations

import torch

from tandem.ext.cuda._loader import cupy_available
from tandem.ext.cuda.mla import mla_attention_cuda
from tandem.ext.cuda.paged_attention import (
    paged_attention_cuda,
    paged_decode,
    paged_extend,
    write_kv,
)


def is_available() -> bool:
    """True when CuPy imports and torch sees a CUDA device."""
    return torch.cuda.is_available() and cupy_available()


__all__ = [
    "is_available",
    "mla_attention_cuda",
    "paged_attention_cuda",
    "paged_decode",
    "paged_extend",
    "write_kv",
]
