"""ext/cpu/rope: the in-place bf16 rotary embedding against ext/attention_ref's rotate_neox."""

from __future__ import annotations

import pytest
import torch

from tandem.ext.attention_ref import rotate_neox
from tandem.ext.cpu.rope import rope_neox_cpu_


@pytest.mark.parametrize("tokens,heads,dim", [(1, 9, 64), (7, 3, 128), (33, 2, 6)])
def test_bitwise_rotate_neox_on_a_strided_view(tokens: int, heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens * heads)
    # q and k as views of one fused projection, as the attention layer makes them
    qkv = torch.randn(tokens, (heads + 1) * dim + 5, generator=gen).bfloat16()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    angles = torch.rand(tokens, 1, dim, generator=gen) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    expected = rotate_neox(q.clone(), cos, sin)
    tail = qkv[:, heads * dim :].clone()
    out = rope_neox_cpu_(q, cos, sin)
    assert out.data_ptr() == q.data_ptr()
    assert torch.equal(q, expected)
    assert torch.equal(qkv[:, heads * dim :], tail)  # the columns after q untouched


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(2, 3, 8).bfloat16()
    cos = torch.ones(2, 1, 8).bfloat16()
    with pytest.raises(ValueError, match="rope"):
        rope_neox_cpu_(x.float(), cos, cos)
    with pytest.raises(ValueError, match="rope"):
        rope_neox_cpu_(x, torch.ones(2, 1, 6).bfloat16(), cos)
    with pytest.raises(ValueError, match="rope"):
        rope_neox_cpu_(x[..., :7], cos[..., :7], cos[..., :7])
    with pytest.raises(ValueError, match="rope"):
        rope_neox_cpu_(x, cos, torch.ones(2, 1, 8))  # sin in another dtype
