"""Tensor parallel with packed weights on the CPU (gloo, 2 processes): each rank keeps its
shard of GGUF, GPTQ/AWQ and FP8 weights packed, and TP=2 logits equal TP=1's; a split that
would cut a quant block dequantizes that layer, one that cannot be packed is refused."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from torch import nn

from tandem.models.config import UnsupportedModelError
from tandem.models.gguf_reader import GGUFReader
from tandem.models.layers.parallel import Shard
from tandem.models.loader.gguf import load_gguf_weights
from tandem.models.quant.linear import QuantEmbedding, QuantLinear
from tandem.models.quant.shard import split_error, take_packed
from tandem.models.quant.tensor import QuantizedTensor
from tandem.runtime.llm import LLM
from tests.models.hf_quant_cases import random_fp8, random_int4, write_quantized
from tests.models.quant_cases import HIDDEN, INTER, write_tiny_gguf
from tests.runtime.test_tensor_parallel import greedy_with_logits

PROMPTS = [[5, 9, 11, 3, 70, 2, 8], [60, 4, 4, 6], [7] * 19]


def _run(path: Path, tp: int, **kw) -> tuple[list[list[int]], list[torch.Tensor], nn.Module]:
    kw.setdefault("dtype", "float32")
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_model_len=128,
              tensor_parallel_size=tp, **kw)  # fmt: skip
    try:
        for proc in llm.engine.tp_group.procs if tp > 1 else ():  # spawned ranks inherit these
            env = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert b"NCCL_NVLS_ENABLE=0" in env and b"TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in env
        ids, seen = greedy_with_logits(llm, PROMPTS, 5)
        return ids, seen, llm.engine.runner.model
    finally:
        llm.engine.close()


def _compare(path: Path, tol: float = 1e-5, **kw) -> nn.Module:
    """TP=2 == TP=1 (logits within `tol` of their largest); returns rank 0's TP=2 model."""
    ids1, logits1, _ = _run(path, 1, **kw)
    ids2, logits2, model = _run(path, 2, **kw)
    assert multiprocessing.active_children() == []
    assert ids2 == ids1
    assert len(logits2) == len(logits1)
    for a, b in zip(logits1, logits2, strict=True):
        assert (b.float() - a.float()).abs().max() / a.float().abs().max() < tol
    return model


@pytest.mark.parametrize(
    "qtype",
    ["Q8_0", "Q4_K", "Q4_0", "Q6_K", pytest.param("Q4_1", marks=pytest.mark.slow),
     pytest.param("Q5_K", marks=pytest.mark.slow)],
)  # fmt: skip
def test_gguf_tp2_keeps_shards_packed(qtype: str, tmp_path: Path) -> None:
    from tests.app.tiny_engine import TinyTokenizer

    head = "Q6_K" if qtype == "Q4_K" else None  # an untied head of another type
    k_quant = qtype.endswith("_K")
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype, head_type=head)
    model = _compare(path, quantization="gguf", tokenizer=TinyTokenizer())
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(model.embed_tokens, QuantEmbedding)  # this rank's 48 of 96 rows, packed
    assert model.embed_tokens.table.shape == (48, HIDDEN)
    if head is None:  # tied: the head reads the embedding's rows
        assert model.quant_head.segments[0] is model.embed_tokens.table
    else:
        assert [s.qtype for s in model.quant_head.segments] == ["Q6_K"]
        assert model.quant_head.out_features == 48
    assert isinstance(attn.qkv_proj, QuantLinear) and attn.qkv_proj.out_features == 128 + 2 * 64
    assert isinstance(mlp.gate_up_proj, QuantLinear) and mlp.gate_up_proj.out_features == INTER
    assert isinstance(mlp.down_proj, QuantLinear) and mlp.down_proj.in_features == INTER // 2
    if not k_quant:  # 32-value blocks: o_proj's 128 columns per rank split cleanly
        assert isinstance(attn.o_proj, QuantLinear) and attn.o_proj.in_features == HIDDEN // 2
    else:  # Q4_K's 256-value blocks would be cut at 128: this layer is dense, sliced
        assert type(attn.o_proj) is nn.Linear and attn.o_proj.weight.shape == (HIDDEN, 128)


def test_gguf_moe_tp2_packed_attention_and_cpu_kernels(tmp_path: Path) -> None:
    # bf16: the CPU packed-weight kernel serves each rank's shard; experts split over ranks
    from tests.app.tiny_engine import TinyTokenizer

    path = write_tiny_gguf(tmp_path / "moe.gguf", "Q8_0", moe=True)
    model = _compare(path, 2e-2, dtype="bfloat16", quantization="gguf", tokenizer=TinyTokenizer())
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.kernel is not None
    assert model.layers[0].mlp.num_local_experts == 2


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_hf_quantized_tp2_keeps_shards_packed(method: str, tmp_path: Path) -> None:
    write_quantized(tmp_path / method, method, group=32)
    model = _compare(tmp_path / method, quantization=method)
    layer = model.layers[1]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(linear, QuantLinear)
    assert layer.mlp.down_proj.in_features == 128  # 256 intermediate over 2 ranks


def test_act_order_row_split_is_refused_naming_dequantize(tmp_path: Path) -> None:
    write_quantized(tmp_path / "ao", "gptq", group=32, act_order=True)
    with pytest.raises(UnsupportedModelError, match="--dequantize"):
        LLM(str(tmp_path / "ao"), device="cpu", dtype="float32", num_kv_blocks=64, quantization="gptq",
            tensor_parallel_size=2)  # fmt: skip
    assert multiprocessing.active_children() == []


def test_gguf_shard_is_a_view_of_the_mapping(tmp_path: Path) -> None:
    reader = GGUFReader(write_tiny_gguf(tmp_path / "m.gguf", "Q8_0"))
    name = "model.layers.0.mlp.gate_proj.weight"
    full = dict(load_gguf_weights(reader, packed={name}))[name]
    shard = Shard(0, INTER // 2, INTER // 2, (INTER, HIDDEN))
    part = dict(load_gguf_weights(reader, packed={name}, shards={name: shard}))[name]
    assert isinstance(part, QuantizedTensor) and part.shape == (INTER // 2, HIDDEN)
    row_bytes = full.data.shape[1]
    assert part.data.data_ptr() == full.data.data_ptr() + INTER // 2 * row_bytes  # no copy
    assert torch.equal(part.dequantize(), full.dequantize()[INTER // 2 :])


def test_take_packed_slices_equal_dequantized_slices() -> None:
    int4 = random_int4(64, 256, 32, seed=1)
    fp8 = random_fp8(64, 256, "block", seed=2)
    for t in (int4, fp8):
        w = t.dequantize()
        assert torch.equal(take_packed(t, 0, 32, 32, "w").dequantize(), w[32:64])
        assert torch.equal(take_packed(t, 1, 128, 128, "w").dequantize(), w[:, 128:])
    with pytest.raises(UnsupportedModelError, match="groups of 32 cut"):
        take_packed(int4, 1, 16, 128, "w")
    # act-order whose groups each lie in one half: packable, with a local permutation
    perm = torch.cat([torch.randperm(128), 128 + torch.randperm(128)]).to(torch.int32)
    ao = type(int4)("gptq", int4.codes, int4.scales, int4.zeros, 32, perm)
    assert torch.equal(take_packed(ao, 1, 128, 128, "w").dequantize(), ao.dequantize()[:, 128:])
    assert split_error("Q4_K", 1, 128, 128, (64, 256)) is not None
    assert split_error("Q4_K", 0, 32, 32, (64, 256)) is None


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_safetensors_shards_are_read_alone(method: str, tmp_path: Path, monkeypatch) -> None:
    from tandem.models.loader import safetensors as st

    write_quantized(tmp_path / method, method, group=32)
    p = "model.layers.0."
    names = {p + "self_attn.q_proj.weight", p + "self_attn.o_proj.weight"}
    names |= {p + "mlp.down_proj.weight", p + "mlp.up_proj.weight"}
    shards = {
        p + "self_attn.q_proj.weight": Shard(0, 64, 64, (128, 128)),
        p + "self_attn.o_proj.weight": Shard(1, 64, 64, (128, 128)),
        p + "mlp.down_proj.weight": Shard(1, 0, 128, (128, 256)),
        p + "mlp.up_proj.weight": Shard(0, 128, 128, (256, 128)),
        "model.embed_tokens.weight": Shard(0, 64, 64, (128, 128)),
    }
    full = dict(st.iter_safetensors_weights(tmp_path / method, torch.float32, packed=names))
    read_whole: list[str] = []
    get = st._Tensors.get

    def spy(self, name: str):
        read_whole.append(name)
        return get(self, name)

    monkeypatch.setattr(st._Tensors, "get", spy)
    parts = dict(
        st.iter_safetensors_weights(tmp_path / method, torch.float32, packed=names, shards=shards)
    )
    for name, s in shards.items():
        want = full[name] if name not in names else full[name].dequantize()
        got = parts[name] if name not in names else parts[name].dequantize()
        assert torch.equal(got, s.take(want)), name
        packed_int4 = name in names and method != "fp8"
        bulk = name.replace(".weight", ".qweight") if packed_int4 else name
        assert bulk not in read_whole, name  # only the slice's bytes were read


def test_gguf_dense_shards_decode_only_their_rows_or_blocks(tmp_path: Path, monkeypatch) -> None:
    from tandem.models.loader import gguf as gguf_loader

    reader = GGUFReader(write_tiny_gguf(tmp_path / "m.gguf", "Q4_K"))
    names = ["model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
             "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"]  # fmt: skip
    full = dict(load_gguf_weights(reader))
    down, o = tuple(full[names[2]].shape), tuple(full[names[3]].shape)
    shards = {
        names[0]: Shard(0, 48, 48, tuple(full[names[0]].shape)),
        names[1]: Shard(0, 128, 128, tuple(full[names[1]].shape)),  # heads 2-3, un-permuted
        names[2]: Shard(1, down[1] // 2, down[1] // 2, down),  # columns on whole blocks
    }
    cutting = Shard(1, 16, 64, o)  # cuts a block: yielded whole (the model's load slices it)
    whole = gguf_loader.dequantize_tensor
    decoded_whole: list[str] = []

    def spy(reader, info, dtype=torch.float32):
        decoded_whole.append(info.name)
        return whole(reader, info, dtype)

    monkeypatch.setattr(gguf_loader, "dequantize_tensor", spy)
    parts = dict(load_gguf_weights(reader, shards={**shards, names[3]: cutting}))
    for name, s in shards.items():
        assert torch.equal(parts[name], s.take(full[name])), name
    assert torch.equal(parts[names[3]], full[names[3]])
    assert "token_embd.weight" not in decoded_whole and "blk.1.attn_q.weight" not in decoded_whole
    assert "blk.0.ffn_down.weight" not in decoded_whole
    assert "blk.1.attn_output.weight" in decoded_whole
    assert "blk.1.attn_k.weight" in decoded_whole  # no shard given: decoded whole
