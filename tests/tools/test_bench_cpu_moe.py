"""tools/bench_cpu_moe.py's layer: the shape presets and the repeated random experts."""

from __future__ import annotations

import sys

import torch

from tools.bench_cpu_moe import SHAPES, parse_args, random_experts


def test_distinct_experts_repeat_to_fill_the_layer() -> None:
    g = torch.Generator().manual_seed(0)
    w13, w2 = random_experts(5, 16, 8, 2, g)
    assert w13.shape == (5, 16, 16) and w2.shape == (5, 16, 8)
    assert w13.dtype == w2.dtype == torch.bfloat16 and w13.is_contiguous()
    assert torch.equal(w13[0], w13[2]) and torch.equal(w2[1], w2[3])
    assert not torch.equal(w13[0], w13[1])
    assert w13[0].data_ptr() != w13[2].data_ptr()  # copies, not views


def test_all_experts_distinct_by_default() -> None:
    w13, w2 = random_experts(4, 16, 8, 0, torch.Generator().manual_seed(0))
    assert all(not torch.equal(w13[i], w13[j]) for i in range(4) for j in range(i + 1, 4))


def test_shape_preset_sets_the_layer(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_cpu_moe.py", "--shape", "deepseek-v3"])
    a = parse_args()
    assert (a.hidden, a.inter, a.experts, a.topk) == SHAPES["deepseek-v3"] == (7168, 2048, 256, 8)
