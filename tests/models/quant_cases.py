"""Tiny random GGUF checkpoints with packed weights, for the models/quant tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tandem.models.quant.reference import quantize_k

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 4, 2, 64, 96


def pack(values: np.ndarray, qtype: str) -> np.ndarray:
    """float [..., K] -> packed uint8 bytes of `qtype` (gguf's quantizer or ours for k-quants)."""
    if qtype.endswith("_K"):
        return quantize_k(values, qtype)
    return gguf.quants.quantize(values.astype(np.float32), Q[qtype])


def write_tiny_gguf(
    path: Path,
    qtype: str,
    *,
    moe: bool = False,
    seed: int = 0,
    head_type: str | None = None,
    experts_type: str | None = None,
) -> Path:
    """A 2-layer "llama" (or "qwen3moe" with 4 experts) GGUF whose matrices are `qtype`;
    `head_type` gives output.weight another type (and unties the head), `experts_type` the
    stacked experts."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    arch = "qwen3moe" if moe else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    kv = {
        "block_count": 2,
        "embedding_length": HIDDEN,
        "feed_forward_length": INTER,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": HEAD_DIM,
        "rope.dimension_count": HEAD_DIM,
        "context_length": 1024,
        "vocab_size": VOCAB,
    }
    for k, v in kv.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if moe:
        w.add_uint32(f"{arch}.expert_count", 4)
        w.add_uint32(f"{arch}.expert_used_count", 2)
        w.add_uint32(f"{arch}.expert_feed_forward_length", 256)

    def add(name: str, values: np.ndarray, t: str = qtype) -> None:
        if t == "F32":
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, pack(values, t), raw_dtype=Q[t])

    add("token_embd.weight", rand(VOCAB, HIDDEN, scale=1.0))
    add("output_norm.weight", 1 + rand(HIDDEN), "F32")
    if head_type is not None:
        add("output.weight", rand(VOCAB, HIDDEN), head_type)
    for i in range(2):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1 + rand(HIDDEN), "F32")
        add(p + "ffn_norm.weight", 1 + rand(HIDDEN), "F32")
        add(p + "attn_q.weight", rand(HEADS * HEAD_DIM, HIDDEN))
        add(p + "attn_k.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN))
        add(p + "attn_v.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN))
        add(p + "attn_output.weight", rand(HIDDEN, HEADS * HEAD_DIM))
        if moe:
            add(p + "attn_q_norm.weight", 1 + rand(HEAD_DIM), "F32")
            add(p + "attn_k_norm.weight", 1 + rand(HEAD_DIM), "F32")
            add(p + "ffn_gate_inp.weight", rand(4, HIDDEN), "F32")
            et = experts_type or qtype
            add(p + "ffn_gate_exps.weight", rand(4, 256, HIDDEN), et)
            add(p + "ffn_up_exps.weight", rand(4, 256, HIDDEN), et)
            add(p + "ffn_down_exps.weight", rand(4, HIDDEN, 256), et)
        else:
            add(p + "ffn_gate.weight", rand(INTER, HIDDEN))
            add(p + "ffn_up.weight", rand(INTER, HIDDEN))
            add(p + "ffn_down.weight", rand(HIDDEN, INTER))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
