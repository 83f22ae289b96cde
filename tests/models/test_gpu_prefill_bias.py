"""models/layers/gpu_prefill.py with GPT-OSS's expert biases and clamped SwiGLU: on the CPU the
grouped computation over the pool's blocked shards against the torch MoE reference (with the
clamps biting), the bias layout of a shard, and `GpuExpertPrefill` against the pool's own
biased kernels; on the GPU (marked) a GPT-OSS model's long prefill through the path against HF
and against the pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.ext.cpu import CpuExpertPool, moe_reference
from tandem.ext.cpu.layout import blocked_to_hf, shard_weights
from tandem.models.layers.experts import ClampedSwiGLU, ExpertBias
from tandem.models.layers.gpu_prefill import (
    GpuExpertPrefill,
    blocked_bias,
    experts_from_shards,
    shard_bias,
)
from tests.models.test_gpu_prefill import _layer, _routing

ALPHA = 1.702


def _bias(E: int, inter: int, H: int, seed: int, limit: float) -> ExpertBias:
    gen = torch.Generator().manual_seed(seed)
    return ExpertBias(
        torch.randn(E, 2 * inter, generator=gen) * 0.5,
        torch.randn(E, H, generator=gen) * 0.5,
        ClampedSwiGLU(ALPHA, limit),
    )


def test_blocked_bias_follows_the_shard_rows() -> None:
    """Each shard's [E, 2Is] bias row, read back through the layout's own blocked -> HF map,
    is that shard's gate then up columns; padding is zero."""
    E, inter, H = 3, 200, 64
    with CpuExpertPool(2, split_nodes=2) as pool:
        _layer(pool, 0, E, inter, H, "bf16")
        b13 = torch.randn(E, 2 * inter)
        shards = [s for s in pool.layer_shards(0) if s.Is]
        assert len(shards) == 2 and shards[1].i0 > 0
        for s in shards:
            got = blocked_bias(b13, s)  # [E, 2Is]
            assert got.shape == (E, 2 * s.Is)
            # as a one-column "w13" [E, 2Is, Hp] the layout's inverse gives [E, 2Iv, 1]
            as_w13 = got[:, :, None].expand(E, 2 * s.Is, s.Hp)
            hf, _ = blocked_to_hf(as_w13, torch.zeros(E, s.Hp, s.Is), s)
            want = torch.cat(
                [b13[:, s.i0 : s.i0 + s.Iv], b13[:, inter + s.i0 : inter + s.i0 + s.Iv]], 1
            )
            assert torch.equal(hf[:, :, 0], want)
            assert float(got.abs().sum()) == pytest.approx(float(want.abs().sum()), rel=1e-6)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("E,inter,H,k,T,split", [(8, 96, 80, 2, 13, 0), (6, 200, 128, 3, 40, 2)])
@pytest.mark.parametrize("grouped", [True, False])
def test_experts_from_shards_with_biases_equal_the_reference(fmt, E, inter, H, k, T, split,
                                                             grouped) -> None:  # fmt: skip
    """fp32: biases split over node shards and padded columns, the clamped SwiGLU, the down
    bias once per routed slot and skipped slots give the torch reference's sum; with a limit
    small enough to clamp, the result differs from the unclamped one (the clamp is applied)."""
    with CpuExpertPool(2, split_nodes=split) as pool:
        w13, w2 = _layer(pool, 0, E, inter, H, fmt)
        ids, w = _routing(T, E, k, seed=T, skip=True)
        x = torch.randn(T, H) * 4
        layouts = [s for s in pool.layer_shards(0) if s.Is]
        shards = [shard_weights(pool.shard_memory(s), s, torch.float32) for s in layouts]
        results = {}
        for limit in (0.3, 1e6):
            bias = _bias(E, inter, H, seed=E, limit=limit)
            sb = shard_bias(bias, layouts, torch.device("cpu"))
            got = experts_from_shards(x, ids, w, shards, {"grouped": grouped}, sb)
            want = moe_reference(x, w13, w2, ids, w, b13=bias.b13, b2=bias.b2,
                                 activation=bias.activation)  # fmt: skip
            assert got.shape == (T, H) and got.dtype == torch.float32
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
            results[limit] = got
        assert (results[0.3] - results[1e6]).abs().max() > 1e-2


def test_prefill_path_with_biases_equals_the_pools_kernels() -> None:
    """`GpuExpertPrefill` over a pool holding a biased layer (GPT-OSS, set_expert_act) and a
    plain one: each call equals the pool's own biased result (the pool rounds activations:
    bf16-sized tolerance) and, in fp32, the torch reference on the pool's weights."""
    E, inter, H, k, T = 8, 160, 128, 2, 24
    with CpuExpertPool(2, split_nodes=2) as pool:
        weights = {layer: _layer(pool, layer, E, inter, H, "int8") for layer in (0, 1)}
        bias = _bias(E, inter, H, seed=3, limit=0.5)
        pool.set_expert_act(1, bias.b13, bias.b2, (ALPHA, 0.5))
        gp = GpuExpertPrefill(pool, [0, 1], torch.device("cpu"), biases={1: bias})
        for step in range(2):
            for layer in (0, 1):
                ids, w = _routing(T, E, k, seed=10 * step + layer, skip=step == 1)
                x = torch.randn(T, H) * 3
                got = gp.run(layer, x, ids, w)
                kw = {}
                if layer == 1:
                    kw = dict(b13=bias.b13, b2=bias.b2, activation=bias.activation)
                want = moe_reference(x, *weights[layer], ids, w, **kw)
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (layer, step)
                ref = pool.forward(layer, x, ids, w)
                rel = float((got - ref).abs().max() / ref.abs().max())
                assert rel < 3e-2, (layer, step, rel)
        # the biased layer's bias is not the plain one's: dropping it changes the output
        plain = GpuExpertPrefill(pool, [1], torch.device("cpu"))
        assert (plain.run(1, x, ids, w) - got).abs().max() > 1e-2
        gp.close()
        plain.close()


# -- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_gpt_oss_prefill_on_gpu_is_as_close_to_hf_as_the_pool(fmt: str, tmp_path: Path) -> None:
    """A bf16 GPT-OSS on CUDA, experts on the pool: a 300-token prefill with gpu_prefill=64
    (taken as 257) computes every MoE layer on the GPU from the pool's bytes (biases and the
    clamped SwiGLU there) and is as close to HF in float32 as the same model with the path off."""
    import transformers as hf

    from tandem.models.batch import KVCache
    from tandem.models.loader import load_model
    from tests.models.test_cpu_pool_cuda import _one_sequence_batch
    from tests.models.test_gpt_oss import GPT_OSS, _save_hf_model, round_experts_as_pool

    cfg = hf.GptOssConfig(**{**GPT_OSS, "hidden_size": 128, "intermediate_size": 96,
                             "sliding_window": 64, "max_position_embeddings": 512})  # fmt: skip
    hf_model = _save_hf_model(cfg, tmp_path)
    round_experts_as_pool(hf_model, fmt)
    logits, n = {}, 300
    for mode in ("64", "off"):
        model, config = load_model(
            tmp_path, dtype=torch.bfloat16, device="cuda", attn_backend="torch",
            expert_backend="cpu_pool",
            expert_options={"fmt": fmt, "gpu_prefill": mode, "expert_cache": False},
        )  # fmt: skip
        kv = KVCache.allocate(3, 24, 16, config.num_key_value_heads, config.head_dim,
                              torch.bfloat16, "cuda")  # fmt: skip
        ids, pos, batch = _one_sequence_batch(n, "cuda", kv)
        ids = (ids * 13) % config.vocab_size
        with torch.no_grad():
            logits[mode] = model.compute_logits(model(ids, pos, batch)).float().cpu()
        s = model.expert_backend.stats()
        assert (s.gpu_prefill_calls == 3) if mode == "64" else (s.gpu_prefill_calls == 0)
        model.expert_backend.close()
    with torch.no_grad():
        ref = hf_model(ids.cpu()[None]).logits[0, -1].float()
    rel = {m: float((v[-1] - ref).abs().max() / ref.abs().max()) for m, v in logits.items()}
    assert rel["64"] <= 1.25 * rel["off"] + 1e-2, rel
    assert rel["64"] < 0.1, rel
