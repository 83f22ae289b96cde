"""The default model (SmolLM2-135M) in bf16 with its dense linears on ext/cpu's small-M kernel.

Greedy tokens do not stay identical over 32 tokens for every prompt: bf16 products summed in a
different order than torch's GEMM flip a near-tie (one prompt in three, at token 24). So this is
a logits-closeness test: teacher-forced decode (both models see the same tokens), the fast
model's logits at every step close to the torch model's, and the same argmax almost always.
"""

from __future__ import annotations

import pytest
import torch

from tandem.ext.cpu.linear import CpuLinearPool
from tandem.models.hub import resolve_model
from tandem.models.layers.cpu_linear import CpuDenseLinear, use_cpu_linear
from tandem.models.loader import load_model

PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [456, 28264, 30, 96, 731],
    [9166, 2402, 253, 655, 28, 281, 253, 1165, 3264],
]
STEPS = 32


@pytest.fixture(scope="module")
def models():
    path = resolve_model(None)
    mp = pytest.MonkeyPatch()
    mp.setenv("TANDEM_CPU_LINEAR", "0")
    ref, config = load_model(path, dtype=torch.bfloat16, device="cpu", quantization="none")
    fast, _ = load_model(path, dtype=torch.bfloat16, device="cpu", quantization="none")
    mp.undo()
    swapped = use_cpu_linear(fast, "bf16", pool=CpuLinearPool(num_threads=1))
    assert swapped == 4 * config.num_hidden_layers + 1
    return ref, fast, config


def test_decode_logits_close(models, paged_runner) -> None:
    ref, fast, config = models
    calls = {"n": 0}
    head = fast.cpu_lm_head
    orig = head.pool.linear

    def counting(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)

    head.pool.linear = counting
    agree = total = 0
    for prompt in PROMPTS:
        runners = [
            paged_runner(m, config, block_size=16, dtype=torch.bfloat16) for m in (ref, fast)
        ]
        lr = runners[0].step([(0, prompt)])[0][-1]
        lf = runners[1].step([(0, prompt)])[0][-1]
        for _ in range(STEPS):
            scale = lr.abs().max().item()
            assert (lf - lr).abs().max().item() < 0.08 * scale
            assert torch.nn.functional.cosine_similarity(lf, lr, dim=0).item() > 0.99
            agree += int(lf.argmax() == lr.argmax())
            total += 1
            tok = int(lr.argmax())  # teacher forcing: both continue with the reference token
            lr = runners[0].step([(0, [tok])])[0][-1]
            lf = runners[1].step([(0, [tok])])[0][-1]
    assert calls["n"] >= len(PROMPTS) * STEPS  # the decode steps went through the kernel
    assert agree >= 0.9 * total, (agree, total)  # measured: 93 of 96


def test_only_bf16_cpu_models_are_swapped() -> None:
    lin = torch.nn.Sequential()
    lin.add_module("qkv_proj", torch.nn.Linear(8, 8))
    assert use_cpu_linear(lin) == 0  # float32: untouched (fp32 output must stay exact)
    lin = lin.to(torch.bfloat16)
    assert use_cpu_linear(lin) == 1 and isinstance(lin.qkv_proj, CpuDenseLinear)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(
        lin.qkv_proj(x).float(),
        torch.nn.functional.linear(x, lin.qkv_proj.weight, lin.qkv_proj.bias).float(),
        rtol=2e-2,
        atol=2e-2,
    )
    with pytest.raises(ValueError):
        use_cpu_linear(lin, "fp8")


def test_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.models.loader import cpu_linear_format

    monkeypatch.setenv("TANDEM_CPU_LINEAR", "int8")
    assert cpu_linear_format() == "int8"
    monkeypatch.setenv("TANDEM_CPU_LINEAR", "0")
    assert cpu_linear_format() is None
    monkeypatch.setenv("TANDEM_CPU_LINEAR", "yes")
    with pytest.raises(ValueError):
        cpu_linear_format()


def _num_fast(model) -> int:
    return sum(isinstance(m, CpuDenseLinear) for m in model.modules())


def test_default_is_auto_and_swaps_bf16_cpu_models_only(monkeypatch) -> None:
    from tandem.ext.cpu import supported_isas
    from tandem.models.loader import cpu_linear_format

    monkeypatch.delenv("TANDEM_CPU_LINEAR", raising=False)
    assert cpu_linear_format() == "auto"
    path = resolve_model(None)
    bf16, config = load_model(path, dtype=torch.bfloat16, device="cpu", quantization="none")
    fast_cpu = bool({"avx512", "amx"} & set(supported_isas()))
    assert _num_fast(bf16) == (4 * config.num_hidden_layers + 1 if fast_cpu else 0)  # + lm_head
    fp32, _ = load_model(path, dtype=torch.float32, device="cpu", quantization="none")
    assert _num_fast(fp32) == 0  # float32 stays on torch: exact parity with HF


def test_auto_falls_back_to_torch_with_a_warning(monkeypatch, caplog) -> None:
    from tandem.ext import cpu as ext_cpu

    def broken() -> list[str]:
        raise RuntimeError("no compiler")

    monkeypatch.delenv("TANDEM_CPU_LINEAR", raising=False)
    monkeypatch.setattr(ext_cpu, "supported_isas", broken)
    with caplog.at_level("WARNING"):
        model, _ = load_model(
            resolve_model(None), dtype=torch.bfloat16, device="cpu", quantization="none"
        )
    assert _num_fast(model) == 0
    assert "fast CPU linear unavailable" in caplog.text and "no compiler" in caplog.text
