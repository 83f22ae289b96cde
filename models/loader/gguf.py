"""Load a GGUF checkpoint as a `ModelConfig` plus HF-named torch tensors.

Owns the mapping from llama.cpp's metadata keys and tensor names to HF's config fields and
checkpoint names, and undoes llama.cpp's row permutation of q/k for "llama"-architecture files.
Parsing lives in `models.gguf_reader`, decoding in `models.gguf_dequant`; this module knows no
model classes: it yields `(hf_name, tensor)` pairs for whoever builds the model.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.gguf_dequant import SUPPORTED_TYPES, dequantize, dequantize_tensor, one_thread
from tandem.models.gguf_reader import GGUFReader, GGUFTensorInfo, ggml_type_name
from tandem.models.layers.parallel import Shard
from tandem.models.loader import gguf_deepseek2, gguf_glm4moe
from tandem.models.quant.experts import EXPERT_KEPT_TYPES
from tandem.models.quant.shard import take_packed
from tandem.models.quant.tensor import GGUF_KEPT_TYPES, QuantizedTensor, ggml_block

logger = logging.getLogger(__name__)

_ARCHITECTURES = {
    # "MixtralForCausalLM" when the file has experts. llama.cpp writes Mistral's files as
    # "llama" too, with no sliding window (and runs them so): Llama's computation is theirs.
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    # q/k not permuted (rope in HF's halves order); attn_q_norm / attn_k_norm span the whole row
    "olmoe": "OlmoeForCausalLM",
    # V2 (softmax gating) or V3 (sigmoid): models/loader/gguf_deepseek2.py decides
    "deepseek2": "DeepseekV3ForCausalLM",
    # llama.cpp's gpt-oss: gate and up experts apart (not interleaved), MXFP4 or any type;
    # windows on the even layers, the clamped SwiGLU's alpha and limit fixed (as llama.cpp)
    "gpt-oss": "GptOssForCausalLM",
    # GLM-4.5/4.6: partial neox rope, DeepSeek-V3 routing; the trailing nextn layers unread
    "glm4moe": "Glm4MoeForCausalLM",
}
# the tensor names an architecture spells its own way (over _LAYER_NAMES)
_ARCH_LAYER_NAMES = {
    gguf_deepseek2.ARCH: gguf_deepseek2.LAYER_NAMES,
    gguf_glm4moe.ARCH: gguf_glm4moe.LAYER_NAMES,
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# blk.N.<gguf> -> model.layers.N.<hf>; "{mlp}" is "mlp" or Mixtral's "block_sparse_moe".
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # gpt-oss
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{mlp}.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Experts: stacked `ffn_<w>_exps` [num_experts, out, in], or per-expert `ffn_<w>.E` (old Mixtral).
_EXPERT_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MIXTRAL_EXPERT_PROJ = {"gate": "w1", "down": "w2", "up": "w3"}
_IGNORED = {"rope_freqs.weight"}  # llama3 rope factors; HF recomputes them from the config

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_SINKS_RE = re.compile(r"^blk\.(\d+)\.attn_sinks(?:\.weight)?$")  # gpt-oss, [num_heads]


def _open(path_or_reader: str | Path | GGUFReader) -> GGUFReader:
    return path_or_reader if isinstance(path_or_reader, GGUFReader) else GGUFReader(path_or_reader)


def _hf_architecture(reader: GGUFReader) -> str:
    arch = reader.architecture
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}"
        )
    if arch == "llama" and int(reader.get("llama.expert_count", 0) or 0) > 0:
        return "MixtralForCausalLM"
    return _ARCHITECTURES[arch]


def _single(value: Any, key: str) -> int:
    """A per-model count; llama.cpp may store it per layer as an array (all equal for us)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"{key} differs between layers ({value}); not supported")
        return int(value[0])
    return int(value)


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = reader.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": float(reader.get(f"{arch}.rope.scaling.factor", 1.0)),
    }
    original = reader.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def gguf_model_config(path: str | Path | GGUFReader) -> ModelConfig:
    """`ModelConfig` from a GGUF file's metadata (and, for bias/tying, its tensor list)."""
    reader = _open(path)
    arch = reader.architecture
    hf_arch = _hf_architecture(reader)

    def key(name: str, default: Any = None) -> Any:
        return reader.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = _single(key("attention.head_count"), f"{arch}.attention.head_count")
    kv_heads = _single(key("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv")
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    num_tokens = reader.metadata.array_len("tokenizer.ggml.tokens") or 0
    num_experts = int(key("expert_count", 0) or 0)
    eos_ids = tuple(
        dict.fromkeys(
            int(reader.get(k))
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if reader.get(k) is not None
        )
    )
    bos = reader.get("tokenizer.ggml.bos_token_id")
    if arch in (gguf_deepseek2.ARCH, gguf_glm4moe.ARCH):
        glm = arch == gguf_glm4moe.ARCH
        common = dict(
            vocab_size=int(key("vocab_size") or num_tokens),
            hidden_size=hidden,
            intermediate_size=_single(key("feed_forward_length", 0), f"{arch}.feed_forward_length"),
            num_hidden_layers=(
                gguf_glm4moe.num_main_layers(reader) if glm else int(key("block_count"))
            ),
            num_attention_heads=heads,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(reader, arch),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in reader.tensors,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            extra={"gguf_architecture": arch, "gguf_file_type": reader.get("general.file_type")},
        )
        if glm:
            return gguf_glm4moe.glm4moe_config(reader, common)
        return gguf_deepseek2.deepseek2_config(reader, common)
    norm_topk = key("expert_weights_norm")
    olmoe = hf_arch == "OlmoeForCausalLM"
    gpt_oss = hf_arch == "GptOssForCausalLM"
    layers = int(key("block_count"))
    window = int(key("attention.sliding_window", 0) or 0) if gpt_oss else 0
    rope_scaling = _rope_scaling(reader, arch)
    if gpt_oss and rope_scaling is not None:
        rope_scaling["truncate"] = False  # transformers' GptOss config
    clip_qkv = key("attention.clamp_kqv") if olmoe else None
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(key("vocab_size") or num_tokens),
        hidden_size=hidden,
        intermediate_size=_single(key("feed_forward_length", 0), f"{arch}.feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in reader.tensors,
        attention_bias="blk.0.attn_q.bias" in reader.tensors,
        o_proj_bias="blk.0.attn_output.bias" in reader.tensors,
        mlp_bias=any(name.endswith(".ffn_down.bias") for name in reader.tensors),
        qk_norm="blk.0.attn_q_norm.weight" in reader.tensors,
        qk_norm_full=olmoe,
        clip_qkv=float(clip_qkv) if clip_qkv is not None else None,
        sliding_window=window or None,
        sliding_layers=tuple(range(0, layers, 2)) if window else (),
        attention_sinks=gpt_oss,
        swiglu_limit=7.0 if gpt_oss else None,
        moe_bias=gpt_oss,
        num_experts=num_experts,
        num_experts_per_tok=int(key("expert_used_count", 0) or 0) if num_experts else 0,
        moe_intermediate_size=(
            int(key("expert_feed_forward_length", 0) or key("feed_forward_length", 0))
            if num_experts
            else 0
        ),
        shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0) or 0),
        norm_topk_prob=bool(norm_topk)
        if norm_topk is not None
        else hf_arch not in ("Qwen2MoeForCausalLM", "OlmoeForCausalLM"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        extra={"gguf_architecture": arch, "gguf_file_type": reader.get("general.file_type")},
    )


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved-pair rope -> HF's rotate_half halves).

    llama.cpp's converter reorders each head's rows `[2, head_dim/2]` -> `[head_dim/2, 2]`; we
    reverse it. `weight`: `[num_heads * head_dim, ...]` (weight or bias) -> same shape.
    """
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _hf_name(
    gguf_name: str, mlp: str, layer_names: dict[str, str] = _LAYER_NAMES
) -> tuple[str, str | None]:
    """(hf name, expert projection or None). Expert names carry an `{e}` placeholder."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name], None
    sinks = _SINKS_RE.match(gguf_name)
    if sinks is not None:
        return f"model.layers.{sinks[1]}.self_attn.sinks", None
    m = _LAYER_RE.match(gguf_name)
    if m is None:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, expert, kind = m.groups()
    prefix = f"model.layers.{layer}"
    w = part[len("ffn_") : -len("_exps")] if part.endswith("_exps") else part[len("ffn_") :]
    if (part.endswith("_exps") or expert is not None) and w in _EXPERT_PROJ:
        proj = _MIXTRAL_EXPERT_PROJ[w] if mlp == "block_sparse_moe" else _EXPERT_PROJ[w]
        e = expert if expert is not None else "{e}"
        return f"{prefix}.{mlp}.experts.{e}.{proj}.{kind}", (None if expert is not None else proj)
    if part not in layer_names:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
    name = f"{prefix}.{layer_names[part].format(mlp=mlp)}.{kind}"
    return name.replace(".e_score_correction.bias", ".e_score_correction_bias"), None


def gguf_packed_tensors(path: str | Path | GGUFReader, experts: bool = False) -> dict[str, str]:
    """HF name -> ggml type of the 2-D, non-expert tensors that can stay packed; with `experts`
    also each expert's slice of the stacked expert tensors whose type the gpu expert backend
    keeps (models/quant/experts.py). Raises `UnsupportedModelError` naming a tensor whose type
    Tandem can neither keep nor decode."""
    reader = _open(path)
    config = gguf_model_config(reader)
    mlp = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    kept: dict[str, str] = {}
    if reader.architecture == gguf_deepseek2.ARCH:
        return kept  # MLA's projections are not swapped for packed layers yet: dequantized
    table = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(reader.architecture, {})}
    for info in reader.tensors.values():
        if info.name in _IGNORED or _unread_layer(info.name, config):
            continue
        qtype = ggml_type_name(info.ggml_type)
        if qtype not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"tensor {info.name!r} has ggml type {qtype}, which Tandem can neither serve"
                f" packed nor dequantize (supported: {', '.join(SUPPORTED_TYPES)}); convert the"
                f" file to one of those types (e.g. llama-quantize ... Q4_K_M)"
            )
        hf_name, stacked = _hf_name(info.name, mlp, table)
        if qtype in GGUF_KEPT_TYPES and stacked is None and len(info.torch_shape) == 2:
            kept[hf_name] = qtype
        elif experts and stacked is not None and qtype in EXPERT_KEPT_TYPES:
            kept.update({hf_name.format(e=e): qtype for e in range(info.torch_shape[0])})
    return kept


def _packed(reader: GGUFReader, info: GGUFTensorInfo) -> QuantizedTensor:
    """Tensor `info` still packed: `[rows, row_bytes]` uint8, a view of the file mapping."""
    rows, cols = info.torch_shape
    # a view of the (copy-on-write) mapping: the layer it is for copies it into its own buffer
    data = torch.from_numpy(reader.tensor_data(info.name))
    return QuantizedTensor(ggml_type_name(info.ggml_type), data.reshape(rows, -1), cols)


def load_gguf_weights(
    path: str | Path | GGUFReader,
    dtype: torch.dtype = torch.float32,
    select: Callable[[str], bool] | None = None,
    packed: frozenset[str] | set[str] = frozenset(),
    shards: Mapping[str, Shard] | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield `(hf_checkpoint_name, tensor)` for every tensor in the file, dequantized to `dtype`.

    q/k of "llama"-architecture files are un-permuted to HF's layout. Stacked expert tensors
    `[num_experts, out, in]` are yielded one expert at a time under HF's per-expert names.
    An unknown tensor name raises `UnsupportedModelError` naming it. `select(hf name)` (a
    stacked tensor's name has `{e}` for the expert) leaves out, undecoded, what it refuses.
    Tensors named in `packed` (see `gguf_packed_tensors`) come as `QuantizedTensor`s, q/k rows
    un-permuted likewise; one with a `shards` entry (tensor parallel) as this rank's slice,
    cut from the file mapping before anything is read (a dense one too, when it is rows).
    """
    reader = _open(path)
    config = gguf_model_config(reader)
    if reader.architecture == gguf_deepseek2.ARCH:
        pieces = _gguf_weights(reader, config, dtype, select, gguf_deepseek2.LAYER_NAMES)
        yield from gguf_deepseek2.merge_kv_b(pieces, config)
        return
    names = _ARCH_LAYER_NAMES.get(reader.architecture, {})
    yield from _gguf_weights(reader, config, dtype, select, names, packed, shards or {})


def _undecoded_shard(shard: Shard | None, info: GGUFTensorInfo) -> slice | None:
    """The bytes of each row of 2-D tensor `info` that `shard` needs, where they can be cut
    from the mapping before decoding: every row's for a row shard, whole blocks' for a column
    shard on block boundaries; None otherwise (the tensor is decoded whole, then sliced)."""
    if shard is None or len(info.torch_shape) != 2 or tuple(info.torch_shape) != shard.full:
        return None
    if shard.dim == 0:
        return slice(None)
    elements, size = ggml_block(ggml_type_name(info.ggml_type))
    if shard.start % elements or shard.length % elements:
        return None
    return slice(shard.start // elements * size, (shard.start + shard.length) // elements * size)


def _unread_layer(gguf_name: str, config: ModelConfig) -> bool:
    """A tensor of a block past the decoder layers (glm4moe's next-token-prediction layer)."""
    m = _BLOCK_RE.match(gguf_name)
    return m is not None and int(m[1]) >= config.num_hidden_layers


def _gguf_weights(
    reader: GGUFReader,
    config: ModelConfig,
    dtype: torch.dtype,
    select: Callable[[str], bool] | None,
    layer_names: dict[str, str],
    packed: frozenset[str] | set[str] = frozenset(),
    shards: Mapping[str, Shard] | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    mlp = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    permute = reader.architecture == "llama"
    table = {**_LAYER_NAMES, **layer_names}
    names = {
        info.name: _hf_name(info.name, mlp, table)
        for info in reader.tensors.values()
        if info.name not in _IGNORED and not _unread_layer(info.name, config)
    }
    for info in reader.tensors.values():
        if info.name in _IGNORED:
            logger.warning("ignoring GGUF tensor %s (derived from the config instead)", info.name)
            continue
        if info.name not in names:  # a layer Tandem does not run
            continue
        hf_name, stacked = names[info.name]
        if select is not None and not select(hf_name):
            continue
        if stacked is not None and hf_name.format(e=0) in packed:  # experts kept packed
            num, rows, cols = info.torch_shape
            qtype = ggml_type_name(info.ggml_type)
            whole = torch.from_numpy(reader.tensor_data(info.name)).reshape(num, rows, -1)
            for e in range(num):  # views of the mapping; the experts' buffer copies each
                yield hf_name.format(e=e), QuantizedTensor(qtype, whole[e], cols)
            continue
        if hf_name in packed:
            qt = _packed(reader, info)
            rows = qt.rows
            shard = (shards or {}).get(hf_name)
            if shard is not None:  # q/k split by whole heads: unpermuted per head below
                qt = take_packed(qt, shard.dim, shard.start, shard.length, hf_name)
            if permute and ".self_attn.q_proj." in hf_name:
                heads = config.num_attention_heads * qt.rows // rows
                qt.data = unpermute_qk(qt.data, heads).contiguous()
            elif permute and ".self_attn.k_proj." in hf_name:
                heads = config.num_key_value_heads * qt.rows // rows
                qt.data = unpermute_qk(qt.data, heads).contiguous()
            yield hf_name, qt
            continue
        with one_thread():  # memory-bound work; see models.gguf_dequant
            keep32 = hf_name.endswith(".e_score_correction_bias")  # stays float32 (routing)
            rows = info.torch_shape[0]
            shard = None if stacked is not None else (shards or {}).get(hf_name)
            cut = _undecoded_shard(shard, info)
            if cut is not None:  # this rank's rows or columns alone, decoded from the mapping
                raw = torch.from_numpy(reader.tensor_data(info.name)).view(rows, -1)
                if shard.dim == 0:
                    part = raw[shard.start : shard.start + shard.length]
                    shape = (shard.length, info.torch_shape[1])
                else:
                    part, shape = raw[:, cut].contiguous(), (rows, shard.length)
                tensor = dequantize(
                    part, info.ggml_type, shape, torch.float32 if keep32 else dtype, info.name
                )
            else:
                tensor = dequantize_tensor(reader, info, torch.float32 if keep32 else dtype)
            if permute and ".self_attn.q_proj." in hf_name:
                tensor = unpermute_qk(tensor, config.num_attention_heads * tensor.shape[0] // rows)
            elif permute and ".self_attn.k_proj." in hf_name:
                tensor = unpermute_qk(tensor, config.num_key_value_heads * tensor.shape[0] // rows)
            elif hf_name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
                tensor = tensor.unsqueeze(0)  # [hidden] -> [1, hidden], HF's Linear(hidden, 1)
        if stacked is not None:
            for e in range(tensor.shape[0]):  # [num_experts, out, in] -> per expert [out, in]
                yield hf_name.format(e=e), tensor[e]
        else:
            yield hf_name, tensor
