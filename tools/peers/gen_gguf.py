#!/usr/bin/env python3
"""Random-weight GGUF files of real shapes, for llama.cpp and Tandem on the same bytes (no
checkpoint can travel to the GPU machine); tools/peers/llama_cpp.sh writes them there.

    python3 tools/peers/gen_gguf.py moe  OUT.gguf [--layers 48] [--experts-type q4_0|q8_0|bf16]
    python3 tools/peers/gen_gguf.py dense OUT.gguf [--layers 32] [--scale N] [--shape 70b]
    python3 tools/peers/gen_gguf.py gpt-oss OUT.gguf [--layers 36] [--experts-type mxfp4|q4_0|q8_0]
    python3 tools/peers/gen_gguf.py glm4moe OUT.gguf [--layers 46] [--experts-type q4_0|q8_0|bf16]

moe:   Qwen3-30B-A3B shape (arch qwen3moe): 48 layers, hidden 2048, 32 q / 4 kv heads of dim
       128, q/k norm, 128 experts top-8, expert intermediate 768, vocab 151936; experts in
       Q4_0 (random fp16 scale of small magnitude + random nibbles, written as bytes), the rest
       BF16 (norms F32).
dense: Llama-3-8B shape (arch llama): 32 layers, hidden 4096, 32/8 heads, intermediate 14336,
       vocab 128256, matrices BF16 or (--dense-type) Q4_0 / Q8_0 / Q4_K (norms F32);
       --shape 70b: Llama-3-70B (80 layers, hidden 8192, 64/8 heads, intermediate 28672).
gpt-oss: gpt-oss-120b shape (arch gpt-oss, tools/shapes/gpt-oss-120b.json) as llama.cpp's
       converter lays it out: attn_sinks, q/k/v/o biases, post_attention_norm, router and expert
       biases (F32), gate and up experts apart, experts MXFP4 by default (random e8m0 scale of
       small magnitude + random e2m1 nibbles), windows of 128 on the even layers, YaRN.
glm4moe: GLM-4.5-Air shape (arch glm4moe, tools/shapes/glm-4.5-air.json): layer 0 dense, then
       128 routed experts top-8 (Q4_0 by default) with one shared expert, sigmoid routing with
       exp_probs_b, q/k/v biases, partial rope (64 of 128 dims); no next-token-prediction block.
--layers cuts any shape to its first N layers; --scale divides hidden, intermediate, heads,
experts and vocab (dimensions kept multiples of 64) for local tests.
Tokenizer: gpt2-style BPE with a synthetic vocab: the 256 byte-level symbols first (so any text
tokenizes, one token per byte), then generated strings, one merge, control tokens at the real
models' special ids. Random values come from a pool that tensors view at random offsets (fast:
the file is written at disk speed; the contents repeat, which does not change the speed of the
arithmetic).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

try:  # the gguf package (PyPI; Tandem's dev extra), else the llama.cpp tree's own copy
    import gguf
except ImportError:
    sys.path.insert(
        0, str(Path(__file__).resolve().parents[2] / ".peers" / "llama.cpp" / "gguf-py")
    )
    import gguf
from gguf import GGMLQuantizationType as Q  # noqa: E402

RNG = np.random.default_rng(0)
SHAPES = Path(__file__).resolve().parents[1] / "shapes"


def bytes_to_unicode() -> list[str]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


class Pools:
    def __init__(self, bf16_elems: int, q_blocks: int, std: float = 0.02) -> None:
        t = time.time()
        x = RNG.standard_normal(bf16_elems, dtype=np.float32) * std
        self.bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
        del x
        self.q4 = np.empty((q_blocks, 18), np.uint8)
        # Q4_0 value = d * (q - 8), q uniform in 0..15: std ~ 4.6 d; d ~ U(0.003, 0.006)
        d = RNG.uniform(0.003, 0.006, q_blocks).astype(np.float16)
        self.q4[:, :2] = d.view(np.uint8).reshape(q_blocks, 2)
        self.q4[:, 2:] = RNG.integers(0, 256, (q_blocks, 16), dtype=np.uint8)
        self.q8 = np.empty((q_blocks, 34), np.uint8)
        d8 = RNG.uniform(0.0002, 0.0004, q_blocks).astype(np.float16)
        self.q8[:, :2] = d8.view(np.uint8).reshape(q_blocks, 2)
        self.q8[:, 2:] = RNG.integers(0, 256, (q_blocks, 32), dtype=np.uint8)
        # Q4_K superblock: d, dmin (fp16), 12 bytes of 6-bit scales/mins (all 32 here), 128
        # bytes of nibbles; dmin = 7.5 d makes 32 d q - 32 dmin zero-mean, std ~ 150 d
        kb = max(1, q_blocks // 8)
        self.q4k = RNG.integers(0, 256, (kb, 144), dtype=np.uint8)
        dk = RNG.uniform(0.0001, 0.0002, kb)
        self.q4k[:, 0:2] = dk.astype(np.float16).view(np.uint8).reshape(kb, 2)
        self.q4k[:, 2:4] = (7.5 * dk).astype(np.float16).view(np.uint8).reshape(kb, 2)
        self.q4k[:, 4:12] = 160  # scales/mins 0-3 = 32, top bits of 4-7 = 2
        self.q4k[:, 12:16] = 0
        # MXFP4 block: one e8m0 scale byte (2^(e - 127)) + 16 bytes of e2m1 nibbles; the
        # nibbles' magnitudes average ~2.1, so e in 119..121 gives std ~0.02
        self.mx = np.empty((q_blocks, 17), np.uint8)
        self.mx[:, 0] = RNG.integers(119, 122, q_blocks, dtype=np.uint8)
        self.mx[:, 1:] = RNG.integers(0, 256, (q_blocks, 16), dtype=np.uint8)
        print(f"pools ready in {time.time() - t:.1f}s", flush=True)

    def bf16_tensor(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        if n <= len(self.bf16) // 2:
            off = int(RNG.integers(0, len(self.bf16) - n))
            return self.bf16[off : off + n].reshape(shape)
        return np.resize(self.bf16, n).reshape(shape)  # a copy, repeating the pool

    def q_tensor(self, shape: tuple[int, ...], kind: str) -> np.ndarray:
        pool, bs, vals = {
            "q4_0": (self.q4, 18, 32),
            "q4_k": (self.q4k, 144, 256),
            "mxfp4": (self.mx, 17, 32),
        }.get(kind, (self.q8, 34, 32))
        nblk = int(np.prod(shape)) // vals
        if nblk <= len(pool) // 2:
            off = int(RNG.integers(0, len(pool) - nblk))
            flat = pool[off : off + nblk]
        else:
            flat = np.resize(pool, (nblk, bs))
        return flat.reshape(*shape[:-1], shape[-1] // vals * bs)


def add_vocab(w: gguf.GGUFWriter, n: int, specials: dict[int, str]) -> None:
    # the one merge's result is a token too, as a BPE tokenizer (Tandem's) requires
    toks = [*bytes_to_unicode(), "Ġt", *(f"tok{i}" for i in range(257, n))]
    types = [1] * n
    for i, s in specials.items():
        toks[i] = s
        types[i] = 3
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])


def f32_ones(n: int) -> np.ndarray:
    return np.ones(n, np.float32)


def write_moe(path: str, layers: int, experts_type: str, scale: int) -> None:
    H, E, K, I = 2048 // scale, 128 // scale, 8, 768 // scale  # noqa: E741
    NH, NKV, HD, V = 32 // scale, 4, 128, 151936 // scale
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name(f"qwen3moe-30B-A3B-shape-random-{experts_type}")
    w.add_context_length(40960)
    w.add_embedding_length(H)
    w.add_block_count(layers)
    w.add_feed_forward_length(6144 // scale)
    w.add_expert_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_file_type(
        gguf.LlamaFileType.MOSTLY_Q4_0
        if experts_type == "q4_0"
        else gguf.LlamaFileType.MOSTLY_Q8_0
        if experts_type == "q8_0"
        else gguf.LlamaFileType.MOSTLY_BF16
    )
    add_vocab(
        w,
        V,
        {V - 293: "<|endoftext|>", V - 292: "<|im_start|>", V - 291: "<|im_end|>"}
        if scale == 1
        else {V - 3: "<|endoftext|>", V - 2: "<|im_start|>", V - 1: "<|im_end|>"},
    )
    bos = V - 293 if scale == 1 else V - 3
    w.add_bos_token_id(bos)
    w.add_eos_token_id(bos + 2)
    w.add_add_bos_token(False)
    P = Pools(
        (512 << 20 if experts_type == "bf16" else 64 << 20) // scale,
        16 << 20 if scale == 1 else 1 << 20,
    )
    BF = Q.BF16
    w.add_tensor("token_embd.weight", P.bf16_tensor((V, H)), raw_dtype=BF)
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", f32_ones(H))
        w.add_tensor(b + "attn_q.weight", P.bf16_tensor((NH * HD, H)), raw_dtype=BF)
        w.add_tensor(b + "attn_k.weight", P.bf16_tensor((NKV * HD, H)), raw_dtype=BF)
        w.add_tensor(b + "attn_v.weight", P.bf16_tensor((NKV * HD, H)), raw_dtype=BF)
        w.add_tensor(b + "attn_output.weight", P.bf16_tensor((H, NH * HD)), raw_dtype=BF)
        w.add_tensor(b + "attn_q_norm.weight", f32_ones(HD))
        w.add_tensor(b + "attn_k_norm.weight", f32_ones(HD))
        w.add_tensor(b + "ffn_norm.weight", f32_ones(H))
        w.add_tensor(b + "ffn_gate_inp.weight", P.bf16_tensor((E, H)).view(np.uint16), raw_dtype=BF)
        for name, shape in (
            ("ffn_gate_exps", (E, I, H)),
            ("ffn_up_exps", (E, I, H)),
            ("ffn_down_exps", (E, H, I)),
        ):
            if experts_type == "bf16":
                w.add_tensor(b + name + ".weight", P.bf16_tensor(shape), raw_dtype=BF)
            else:
                w.add_tensor(
                    b + name + ".weight",
                    P.q_tensor(shape, experts_type),
                    raw_dtype=Q.Q4_0 if experts_type == "q4_0" else Q.Q8_0,
                )
    w.add_tensor("output_norm.weight", f32_ones(H))
    w.add_tensor("output.weight", P.bf16_tensor((V, H)), raw_dtype=BF)
    finish(w, path)


QTYPES = {"q4_0": Q.Q4_0, "q8_0": Q.Q8_0, "mxfp4": Q.MXFP4, "bf16": Q.BF16}
FILE_TYPES = {
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "mxfp4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
}


def _shape(name: str) -> dict:
    return json.loads((SHAPES / f"{name}.json").read_text())


def _dim(n: int, scale: int) -> int:
    """n / scale, a multiple of 64 (every quantized row holds whole blocks)."""
    return n if scale == 1 else max(64, n // scale // 64 * 64)


def _small(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)


def _experts(w: gguf.GGUFWriter, P: Pools, name: str, shape: tuple[int, ...], kind: str) -> None:
    if kind == "bf16":
        w.add_tensor(name, P.bf16_tensor(shape), raw_dtype=Q.BF16)
    else:
        w.add_tensor(name, P.q_tensor(shape, kind), raw_dtype=QTYPES[kind])


def _vocab_and_embedding(
    w: gguf.GGUFWriter, V: int, H: int, specials: dict[int, str], bos: int, eos: int, scale: int
) -> Pools:
    """The vocabulary, its special ids and the token embedding; the weight pools (larger at
    full scale) the rest of the file draws from."""
    add_vocab(w, V, specials)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    P = Pools(64 << 20 if scale == 1 else 1 << 20, 16 << 20 if scale == 1 else 1 << 20)
    w.add_tensor("token_embd.weight", P.bf16_tensor((V, H)), raw_dtype=Q.BF16)
    return P


def _biased_attention(w: gguf.GGUFWriter, P: Pools, b: str, H: int, q: int, kv: int) -> None:
    """A layer's two norms and its q/k/v projections with biases, o without."""
    w.add_tensor(b + "attn_norm.weight", f32_ones(H))
    w.add_tensor(b + "post_attention_norm.weight", f32_ones(H))
    for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
        w.add_tensor(b + name + ".weight", P.bf16_tensor((rows, H)), raw_dtype=Q.BF16)
        w.add_tensor(b + name + ".bias", _small(rows))
    w.add_tensor(b + "attn_output.weight", P.bf16_tensor((H, q)), raw_dtype=Q.BF16)


def write_gpt_oss(path: str, layers: int | None, experts_type: str, scale: int) -> None:
    c = _shape("gpt-oss-120b")
    H, I = _dim(c["hidden_size"], scale), _dim(c["intermediate_size"], scale)  # noqa: E741
    E, K = c["num_local_experts"] // scale, c["num_experts_per_tok"]
    NH, NKV, HD = c["num_attention_heads"] // scale, c["num_key_value_heads"], c["head_dim"]
    V, L = c["vocab_size"] // scale, layers or c["num_hidden_layers"]
    rope = c["rope_scaling"]
    a = "gpt-oss"
    w = gguf.GGUFWriter(path, a)
    w.add_name(f"gpt-oss-120b-shape-random-{experts_type}")
    for key, value in {
        "context_length": c["max_position_embeddings"], "embedding_length": H,
        "block_count": L, "feed_forward_length": I, "expert_feed_forward_length": I,
        "attention.head_count": NH, "attention.head_count_kv": NKV,
        "attention.key_length": HD, "attention.value_length": HD,
        "rope.freq_base": float(c["rope_theta"]), "attention.layer_norm_rms_epsilon": 1e-5,
        "expert_count": E, "expert_used_count": K,
        "attention.sliding_window": c["sliding_window"], "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
    }.items():  # fmt: skip
        {int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)](
            f"{a}.{key}", value
        )
    w.add_file_type(FILE_TYPES[experts_type])
    specials = (
        {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
         200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>"}
        if scale == 1
        else {V - 3: "<|endoftext|>", V - 2: "<|return|>", V - 1: "<|end|>"}
    )  # fmt: skip
    P = _vocab_and_embedding(w, V, H, specials, 199998 if scale == 1 else V - 3,
                             200002 if scale == 1 else V - 2, scale)  # fmt: skip
    BF = Q.BF16
    for i in range(L):
        b = f"blk.{i}."
        _biased_attention(w, P, b, H, NH * HD, NKV * HD)
        w.add_tensor(b + "attn_output.bias", _small(H))
        w.add_tensor(b + "attn_sinks.weight", _small(NH))
        w.add_tensor(b + "ffn_gate_inp.weight", P.bf16_tensor((E, H)), raw_dtype=BF)
        w.add_tensor(b + "ffn_gate_inp.bias", _small(E))
        for name, shape in (("ffn_gate_exps", (E, I, H)), ("ffn_up_exps", (E, I, H)),
                            ("ffn_down_exps", (E, H, I))):  # fmt: skip
            _experts(w, P, b + name + ".weight", shape, experts_type)
            w.add_tensor(b + name + ".bias", _small(E, shape[1]))
    w.add_tensor("output_norm.weight", f32_ones(H))
    w.add_tensor("output.weight", P.bf16_tensor((V, H)), raw_dtype=BF)
    finish(w, path)


def write_glm4moe(path: str, layers: int | None, experts_type: str, scale: int) -> None:
    c = _shape("glm-4.5-air")
    H, FF = _dim(c["hidden_size"], scale), _dim(c["intermediate_size"], scale)
    I = _dim(c["moe_intermediate_size"], scale)  # noqa: E741
    E, K = c["n_routed_experts"] // scale, c["num_experts_per_tok"]
    NH, NKV = c["num_attention_heads"] // scale, max(1, c["num_key_value_heads"] // scale)
    HD, V, L = c["head_dim"], c["vocab_size"] // scale, layers or c["num_hidden_layers"]
    dense, shared = c["first_k_dense_replace"], c["n_shared_experts"]
    a = "glm4moe"
    w = gguf.GGUFWriter(path, a)
    w.add_name(f"glm-4.5-air-shape-random-{experts_type}")
    for key, value in {
        "context_length": c["max_position_embeddings"], "embedding_length": H,
        "block_count": L, "feed_forward_length": FF, "expert_feed_forward_length": I,
        "attention.head_count": NH, "attention.head_count_kv": NKV,
        "attention.key_length": HD, "attention.value_length": HD,
        "rope.dimension_count": int(HD * c["partial_rotary_factor"]),
        "rope.freq_base": float(c["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        "expert_count": E, "expert_used_count": K, "expert_shared_count": shared,
        "leading_dense_block_count": dense, "expert_gating_func": 2,
        "expert_weights_scale": float(c["routed_scaling_factor"]),
        "nextn_predict_layers": 0,
    }.items():  # fmt: skip
        {int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)](
            f"{a}.{key}", value
        )
    w.add_bool(f"{a}.expert_weights_norm", bool(c["norm_topk_prob"]))
    w.add_file_type(FILE_TYPES[experts_type])
    specials = (
        {151329: "<|endoftext|>", 151331: "[gMASK]", 151333: "<sop>", 151336: "<|user|>",
         151337: "<|assistant|>"}
        if scale == 1
        else {V - 3: "<|endoftext|>", V - 2: "<|user|>", V - 1: "<|assistant|>"}
    )  # fmt: skip
    eos = 151329 if scale == 1 else V - 3
    P = _vocab_and_embedding(w, V, H, specials, eos, eos, scale)
    BF = Q.BF16
    for i in range(L):
        b = f"blk.{i}."
        _biased_attention(w, P, b, H, NH * HD, NKV * HD)
        if i < dense:
            w.add_tensor(b + "ffn_gate.weight", P.bf16_tensor((FF, H)), raw_dtype=BF)
            w.add_tensor(b + "ffn_up.weight", P.bf16_tensor((FF, H)), raw_dtype=BF)
            w.add_tensor(b + "ffn_down.weight", P.bf16_tensor((H, FF)), raw_dtype=BF)
            continue
        w.add_tensor(b + "ffn_gate_inp.weight", P.bf16_tensor((E, H)), raw_dtype=BF)
        w.add_tensor(b + "exp_probs_b.bias", _small(E))
        for name, shape in (("ffn_gate_exps", (E, I, H)), ("ffn_up_exps", (E, I, H)),
                            ("ffn_down_exps", (E, H, I))):  # fmt: skip
            _experts(w, P, b + name + ".weight", shape, experts_type)
        Is = I * shared
        w.add_tensor(b + "ffn_gate_shexp.weight", P.bf16_tensor((Is, H)), raw_dtype=BF)
        w.add_tensor(b + "ffn_up_shexp.weight", P.bf16_tensor((Is, H)), raw_dtype=BF)
        w.add_tensor(b + "ffn_down_shexp.weight", P.bf16_tensor((H, Is)), raw_dtype=BF)
    w.add_tensor("output_norm.weight", f32_ones(H))
    w.add_tensor("output.weight", P.bf16_tensor((V, H)), raw_dtype=BF)
    finish(w, path)


def write_dense(
    path: str, layers: int, scale: int, dense_type: str = "bf16", shape: str = "8b"
) -> None:
    big = shape == "70b"
    H, FF, NH, NKV, HD, V = (
        (8192 if big else 4096) // scale,
        (28672 if big else 14336) // scale,
        (64 if big else 32) // scale,
        8 // scale,
        128,
        128256 // scale,
    )
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"llama-3-{shape}-shape-random-{dense_type}")
    w.add_context_length(8192)
    w.add_embedding_length(H)
    w.add_block_count(layers)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_dimension_count(HD)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    F = gguf.LlamaFileType  # the file's label (llama-bench prints it); the tensors carry their type
    w.add_file_type(
        {
            "bf16": F.MOSTLY_BF16,
            "q4_0": F.MOSTLY_Q4_0,
            "q8_0": F.MOSTLY_Q8_0,
            "q4_k": F.MOSTLY_Q4_K_S,
        }[dense_type]
    )
    sp = {V - 256: "<|begin_of_text|>", V - 255: "<|end_of_text|>", V - 247: "<|eot_id|>"}
    add_vocab(w, V, sp)
    w.add_bos_token_id(V - 256)
    w.add_eos_token_id(V - 255)
    w.add_add_bos_token(False)
    P = Pools(128 << 20, 1 << 10 if dense_type == "bf16" else 1 << 24)

    def mat(name: str, shape: tuple[int, int]) -> None:  # every matrix in dense_type
        if dense_type == "bf16":
            w.add_tensor(name, P.bf16_tensor(shape), raw_dtype=Q.BF16)
        else:
            w.add_tensor(name, P.q_tensor(shape, dense_type), raw_dtype=Q[dense_type.upper()])

    mat("token_embd.weight", (V, H))
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", f32_ones(H))
        mat(b + "attn_q.weight", (NH * HD, H))
        mat(b + "attn_k.weight", (NKV * HD, H))
        mat(b + "attn_v.weight", (NKV * HD, H))
        mat(b + "attn_output.weight", (H, NH * HD))
        w.add_tensor(b + "ffn_norm.weight", f32_ones(H))
        mat(b + "ffn_gate.weight", (FF, H))
        mat(b + "ffn_up.weight", (FF, H))
        mat(b + "ffn_down.weight", (H, FF))
    w.add_tensor("output_norm.weight", f32_ones(H))
    mat("output.weight", (V, H))
    finish(w, path)


def finish(w: gguf.GGUFWriter, path: str) -> None:
    t = time.time()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = Path(path).stat().st_size
    print(f"{path}: {size / 1e9:.2f} GB written in {time.time() - t:.1f}s", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["moe", "dense", "gpt-oss", "glm4moe"])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument(
        "--experts-type", default=None, choices=["q4_0", "q8_0", "bf16", "mxfp4"],
        help="moe/glm4moe: q4_0 by default; gpt-oss: mxfp4 by default",
    )  # fmt: skip
    ap.add_argument("--scale", type=int, default=1, help="divide dims by this (local tests)")
    ap.add_argument("--dense-type", default="bf16", choices=["q4_0", "q8_0", "q4_k", "bf16"])
    ap.add_argument("--shape", default="8b", choices=["8b", "70b"], help="dense only")
    a = ap.parse_args()
    if a.experts_type == "mxfp4" and a.kind != "gpt-oss":
        ap.error("--experts-type mxfp4 is for gpt-oss (llama.cpp reads MXFP4 experts there)")
    if a.kind == "moe":
        write_moe(a.out, a.layers or 48, a.experts_type or "q4_0", a.scale)
    elif a.kind == "gpt-oss":
        write_gpt_oss(a.out, a.layers, a.experts_type or "mxfp4", a.scale)
    elif a.kind == "glm4moe":
        write_glm4moe(a.out, a.layers, a.experts_type or "q4_0", a.scale)
    else:
        write_dense(
            a.out, a.layers or (80 if a.shape == "70b" else 32), a.scale, a.dense_type, a.shape
        )
