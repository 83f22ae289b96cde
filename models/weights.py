"""Maps HF checkpoint tensor names onto `DecoderForCausalLM`'s fused parameters.

Owns the name scheme: q/k/v -> qkv_proj rows, gate/up -> gate_up_proj rows (biases alike),
per-expert tensors (`mlp.experts.{e}.gate_proj` or Mixtral's
`block_sparse_moe.experts.{e}.w1/w2/w3`) and transformers' fused 3D expert tensors
(`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj` `[E, H, I]`) -> stacked
w13/w2. Every expected tensor must arrive exactly as the checkpoint shapes it; anything else is
an `UnsupportedModelError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.layers.parallel import Shard, tensor_parallel_shards
from tandem.models.quant.fp8 import Fp8Tensor
from tandem.models.quant.int4 import Int4Tensor
from tandem.models.quant.shard import take_packed
from tandem.models.quant.tensor import QuantizedTensor

PACKED = (QuantizedTensor, Int4Tensor, Fp8Tensor)  # checkpoint weights still in their format

if TYPE_CHECKING:
    from tandem.models.decoder import DecoderForCausalLM

# Checkpoint names that carry no parameters (buffers some exporters include).
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Families whose checkpoints append multi-token-prediction modules as extra layers past
# num_hidden_layers (DeepSeek-V3's layer 61); serving does not use them.
_MTP_FAMILIES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "Glm4MoeForCausalLM")


def is_mtp(name: str, cfg: ModelConfig) -> bool:
    """A tensor of a DeepSeek / GLM-4.5 multi-token-prediction layer (index >=
    num_hidden_layers)."""
    m = _LAYER.match(name)
    return (
        cfg.architecture in _MTP_FAMILIES and m is not None
        and int(m[1]) >= cfg.num_hidden_layers
    )  # fmt: skip


_FUSED_EXPERTS = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(\.weight)?$"
)
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Any routed-expert tensor of a layer (per expert, fused 3D, or a GGUF "{e}" template); never
# the router ("mlp.gate") or a shared expert ("mlp.shared_expert.").
_EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.")


def expert_layer(name: str) -> int | None:
    """The layer of a routed-expert weight tensor (HF checkpoint or canonical name), else None.
    Expert biases (GPT-OSS) are not counted: they are small and an expert backend needs them
    even for a layer whose weights it does not read (cpu_pool: mapped from its cache)."""
    m = _EXPERT_TENSOR.match(name)
    return int(m[1]) if m and not name.endswith("bias") else None


def _canonical(name: str) -> str:
    """Mixtral's names -> the `mlp.experts.{e}.gate_proj` scheme used for targets."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(
        r"\.experts\.(\d+)\.(w[123])\.", lambda m: f".experts.{m[1]}.{_MIXTRAL_EXPERT[m[2]]}.", name
    )


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name in the scheme of the model's targets (Mixtral's experts)."""
    return _canonical(name)


def _display(name: str, architecture: str) -> str:
    """A target name as this architecture's checkpoints spell it (for error messages)."""
    if architecture != "MixtralForCausalLM":
        return name
    inverse = {v: k for k, v in _MIXTRAL_EXPERT.items()}
    name = re.sub(
        r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.",
        lambda m: f".experts.{m[1]}.{inverse[m[2]]}.",
        name,
    )
    return name.replace(".mlp.", ".block_sparse_moe.")


def _targets(model: DecoderForCausalLM) -> dict[str, torch.Tensor]:
    """Canonical HF name -> the parameter view it fills."""
    rows = getattr(model.embed_tokens, "num_rows", None)  # TP: this rank's vocab rows
    t: dict[str, torch.Tensor] = {"model.norm.weight": model.norm.weight}
    if model.embed_tokens.weight is not None:  # None: packed (models/quant)
        w = model.embed_tokens.weight
        t["model.embed_tokens.weight"] = w if rows is None else w[:rows]
    if model.lm_head is not None:
        w = model.lm_head.weight
        t["lm_head.weight"] = w if rows is None else w[:rows]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        t[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        attn = layer.self_attn
        if hasattr(attn, "kv_b_proj"):  # DeepSeek's MLA: its linears and norms as they are
            _module_targets(t, p + "self_attn.", attn)
        else:
            q, kv = attn.q_size, attn.kv_size  # this rank's rows
            params = ["weight", "bias"] if attn.qkv_proj.bias is not None else ["weight"]
            for kind in _dense(attn.qkv_proj, params):
                fused = getattr(attn.qkv_proj, kind)
                t[p + f"self_attn.q_proj.{kind}"] = fused[:q]
                t[p + f"self_attn.k_proj.{kind}"] = fused[q : q + kv]
                t[p + f"self_attn.v_proj.{kind}"] = fused[q + kv :]
            if attn.o_proj.weight is not None:
                t[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
            if attn.o_proj.bias is not None:
                t[p + "self_attn.o_proj.bias"] = attn.o_proj.bias
            if attn.sinks is not None:
                t[p + "self_attn.sinks"] = attn.sinks
            if attn.q_norm is not None and attn.k_norm is not None:
                t[p + "self_attn.q_norm.weight"] = attn.q_norm.weight
                t[p + "self_attn.k_norm.weight"] = attn.k_norm.weight
        mlp = layer.mlp
        if hasattr(mlp, "w13"):  # packed experts (models/quant/experts.py) load through set_part
            inter = mlp.w2.shape[2]
            t[p + "mlp.gate.weight"] = mlp.gate.weight
            if mlp.gate.bias is not None:
                t[p + "mlp.gate.bias"] = mlp.gate.bias
            first = getattr(mlp, "expert_start", 0)
            dense = isinstance(mlp.w13, torch.Tensor)
            for j in range(mlp.w13.shape[0]):  # this rank's experts (all without parallelism)
                e = first + j
                if dense:
                    t[p + f"mlp.experts.{e}.gate_proj.weight"] = mlp.w13[j, :inter]
                    t[p + f"mlp.experts.{e}.up_proj.weight"] = mlp.w13[j, inter:]
                    t[p + f"mlp.experts.{e}.down_proj.weight"] = mlp.w2[j]
                if getattr(mlp, "w13_bias", None) is not None:  # GPT-OSS
                    t[p + f"mlp.experts.{e}.gate_proj.bias"] = mlp.w13_bias[j, :inter]
                    t[p + f"mlp.experts.{e}.up_proj.bias"] = mlp.w13_bias[j, inter:]
                    t[p + f"mlp.experts.{e}.down_proj.bias"] = mlp.w2_bias[j]
            if getattr(mlp, "e_score_correction_bias", None) is not None:
                t[p + "mlp.gate.e_score_correction_bias"] = mlp.e_score_correction_bias
            if getattr(mlp, "shared_experts", None) is not None:
                _gated_mlp_targets(t, p + "mlp.shared_experts.", mlp.shared_experts)
            if mlp.shared_expert is not None:
                _gated_mlp_targets(t, p + "mlp.shared_expert.", mlp.shared_expert)
                t[p + "mlp.shared_expert_gate.weight"] = mlp.shared_expert_gate.weight
        else:
            _gated_mlp_targets(t, p + "mlp.", mlp)
    return t


def _discarded(model: DecoderForCausalLM) -> dict[str, tuple[int, ...]]:
    """Canonical HF name -> shape of tensors a checkpoint may carry that contribute nothing,
    accepted (shape-checked) and dropped: a Qwen2-MoE with shared_expert_intermediate_size 0
    saves its shared expert as zero-size tensors, and the shared_expert_gate that scales that
    expert's zero output."""
    cfg = model.config
    if cfg.architecture != "Qwen2MoeForCausalLM" or cfg.shared_expert_intermediate_size > 0:
        return {}
    hidden = cfg.hidden_size
    d: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            p = f"model.layers.{i}.mlp."
            d[p + "shared_expert.gate_proj.weight"] = (0, hidden)
            d[p + "shared_expert.up_proj.weight"] = (0, hidden)
            d[p + "shared_expert.down_proj.weight"] = (hidden, 0)
            d[p + "shared_expert_gate.weight"] = (1, hidden)
    return d


def _module_targets(t: dict[str, torch.Tensor], prefix: str, module: torch.nn.Module) -> None:
    """Every parameter of `module` under its own dotted name (linears, norms)."""
    for name, param in module.named_parameters():
        t[prefix + name] = param


def _gated_mlp_targets(t: dict[str, torch.Tensor], prefix: str, mlp: torch.nn.Module) -> None:
    inter = mlp.intermediate_size
    params = ["weight", "bias"] if mlp.gate_up_proj.bias is not None else ["weight"]
    for kind in _dense(mlp.gate_up_proj, params):
        fused = getattr(mlp.gate_up_proj, kind)
        t[prefix + f"gate_proj.{kind}"] = fused[:inter]
        t[prefix + f"up_proj.{kind}"] = fused[inter:]
    for kind in _dense(mlp.down_proj, params):
        t[prefix + f"down_proj.{kind}"] = getattr(mlp.down_proj, kind)


def _dense(module: torch.nn.Module, params: list[str]) -> list[str]:
    """The params of a linear that load as dense tensors (a packed one's weight does not)."""
    return [k for k in params if getattr(module, k) is not None]


def _quant_targets(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """HF name -> the packed layers (models/quant) that take it, with the part index."""
    out: dict[str, list] = {}
    for module in model.modules():
        for i, name in enumerate(getattr(module, "source_names", ())):
            out.setdefault(name, []).append((module, i))
    return out


def _split(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One checkpoint tensor -> (canonical name, tensor) pieces."""
    name = _canonical(name)
    m = _FUSED_EXPERTS.match(name)
    if m is None:
        yield name, tensor
        return
    prefix, kind = m[1], m[2]
    if tensor.dim() != 3:
        raise UnsupportedModelError(
            f"fused expert tensor {name} must be 3-D, got {tuple(tensor.shape)}"
        )
    for e in range(tensor.shape[0]):
        if kind == "down_proj":  # [E, H, I]
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        else:  # [E, 2I, H]: gate rows, then up rows
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up


def _check_shape(
    name: str, piece: torch.Tensor, shape: tuple[int, ...], canon: str, arch: str
) -> None:
    if tuple(piece.shape) != shape:
        raise UnsupportedModelError(
            f"tensor {name!r} has shape {tuple(piece.shape)}, {arch} expects {shape} for "
            f"{_display(canon, arch)}"
        )


def load_hf_weights(
    model: DecoderForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    expected: Callable[[str], bool] | None = None,
) -> None:
    """Copies `weights` into `model`. `expected(canonical name)` narrows the parameters that
    must arrive (default: all of them); a tensor outside it is unexpected."""
    arch = model.config.architecture
    targets = _targets(model)
    discarded = _discarded(model)
    shards: dict[str, Shard] = {}
    if (
        getattr(model, "tp", None) is not None and model.tp.size > 1
    ):  # each rank keeps its slices of the tensors as they stream by
        shards, others = tensor_parallel_shards(model)
        discarded.update(others)
    if expected is not None:
        targets = {n: t for n, t in targets.items() if expected(n)}
        discarded = {n: s for n, s in discarded.items() if expected(n)}
    quant = _quant_targets(model)
    if expected is not None:
        quant = {n: m for n, m in quant.items() if expected(n)}
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if _IGNORED.match(name) or is_mtp(name, model.config):
                continue
            if isinstance(tensor, PACKED):
                canon = _canonical(name)
                if canon in quant:
                    shard = shards.get(canon)
                    if shard is not None and tuple(tensor.shape) == shard.full:
                        tensor = take_packed(tensor, shard.dim, shard.start, shard.length, name)
                    for module, index in quant[canon]:  # each copies it into its own buffer
                        module.set_part(index, tensor)
                    filled.add(canon)
                    continue
                tensor = tensor.dequantize(torch.float32)  # a dense target: as before
            for canon, piece in _split(name, tensor):
                dst = targets.get(canon)
                if dst is None and canon in discarded:
                    _check_shape(name, piece, discarded[canon], canon, arch)
                    continue
                if dst is None:
                    if canon == "lm_head.weight" and model.lm_head is None:
                        continue  # tied embeddings: the embedding matrix is the head
                    raise UnsupportedModelError(f"unexpected tensor {name!r} for {arch}")
                shard = shards.get(canon)
                if shard is not None and tuple(piece.shape) != tuple(dst.shape):
                    _check_shape(name, piece, shard.full, canon, arch)
                if shard is not None and tuple(piece.shape) == shard.full:
                    piece = shard.take(piece)  # else the loader read this rank's slice alone
                _check_shape(name, piece, tuple(dst.shape), canon, arch)
                dst.copy_(piece)
                filled.add(canon)
    for module in model.modules():
        if hasattr(module, "source_names") and hasattr(module, "finalize"):
            module.finalize()  # e.g. a tied packed head takes the embedding's table
    missing = [n for n in list(targets) + list(quant) if n not in filled]
    if missing:
        shown = ", ".join(_display(n, arch) for n in missing[:8])
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise UnsupportedModelError(f"missing tensors for {arch}: {shown}{more}")
