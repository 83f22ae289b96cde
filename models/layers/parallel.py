"""Tensor parallelism for the shared decoder: this process's rank in the group, how each
weight splits across ranks (Megatron column/row splits by heads and intermediate rows, a vocab
split for embedding and lm_head, whole experts per rank for MoE), and the collectives the
sharded layers call (one all-reduce after each row-parallel projection, a gather of logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.models.config import ModelConfig, UnsupportedModelError

if TYPE_CHECKING:
    from tandem.models.decoder import DecoderForCausalLM

# Architectures built from `DecoderForCausalLM`/`DecoderLayer`, whose layers shard themselves.
TP_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "MixtralForCausalLM",
        "OlmoeForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "Glm4MoeForCausalLM",
        "GptOssForCausalLM",
    }
)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (the default group of
    torch.distributed when size > 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group (None: the default one)

    @property
    def live(self) -> bool:
        """Whether the collectives run: several ranks, or a group of one joined on purpose
        (its all-reduces then run too, e.g. to capture them in CUDA graphs on one GPU)."""
        return self.size > 1 or self.group is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.live:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor | None:
        """Every rank's `[N, c]` -> `[N, width]` (the ranks' columns side by side, cut to
        `width`) on rank 0; None on the others. On CUDA an all-gather (every rank gets them:
        NCCL's all-gather is one kernel, capturable in a CUDA graph); gloo gathers to rank 0."""
        if not self.live:
            return x[:, :width]
        x = x.contiguous()
        if x.is_cuda:
            out = torch.empty(self.size, *x.shape, dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            full = out.permute(1, 0, 2).reshape(x.shape[0], -1)[:, :width]
            return full if self.rank == 0 else None
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=1)[:, :width] if parts is not None else None


_current = TensorParallel()


def get_tp() -> TensorParallel:
    """The group layers shard for when they are built (size 1 unless the runtime set one)."""
    return _current


def set_tp(tp: TensorParallel) -> None:
    global _current
    _current = tp


def even_split(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of `total` rows."""
    if total % tp.size:
        raise UnsupportedModelError(
            f"{what} ({total}) is not divisible by --tensor-parallel-size {tp.size}"
        )
    per = total // tp.size
    return tp.rank * per, per


def head_split(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[int, int, int, int]:
    """(first q head, q heads, first kv head, kv heads) of this rank. KV heads are split when
    there are at least as many as ranks, else each rank keeps the one its q heads use."""
    q0, nq = even_split(num_heads, tp, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv0, nkv = even_split(num_kv_heads, tp, "num_key_value_heads")
        return q0, nq, kv0, nkv
    if tp.size % num_kv_heads:
        raise UnsupportedModelError(
            f"--tensor-parallel-size {tp.size} must be a multiple of num_key_value_heads "
            f"({num_kv_heads}) when it exceeds them"
        )
    return q0, nq, tp.rank * num_kv_heads // tp.size, 1


def check_tensor_parallel(config: ModelConfig, tp_size: int, expert_backend: str) -> None:
    """Refuse, before any weight is read, a model or option tensor parallelism cannot serve."""
    if tp_size == 1:
        return
    if tp_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp_size}")
    if config.architecture not in TP_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{config.architecture} does not support --tensor-parallel-size > 1 yet; "
            f"supported: {', '.join(sorted(TP_ARCHITECTURES))}"
        )
    if config.is_moe and expert_backend != "torch":
        raise ValueError(
            f"--tensor-parallel-size {tp_size} shards experts with the torch expert backend "
            f"only, not {expert_backend!r} (leave --expert-backend auto, no --cpu-experts)"
        )
    if config.qk_norm and config.qk_norm_full and config.num_key_value_heads % tp_size:
        raise UnsupportedModelError(
            f"{config.architecture}'s q/k norm spans all heads: num_key_value_heads "
            f"({config.num_key_value_heads}) must be divisible by --tensor-parallel-size"
        )
    probe = [TensorParallel(r, tp_size) for r in range(tp_size)]
    if config.is_mla:  # heads split; the latent path is replicated
        even_split(config.num_attention_heads, probe[0], "num_attention_heads")
    else:
        head_split(config.num_attention_heads, config.num_key_value_heads, probe[0])
    if config.is_moe:
        even_split(config.num_experts, probe[0], "num_experts")
        if config.shared_expert_intermediate_size:
            even_split(config.shared_expert_intermediate_size, probe[0], "shared expert size")
        if config.n_shared_experts:
            shared = config.moe_intermediate_size * config.n_shared_experts
            even_split(shared, probe[0], "the shared experts' intermediate size")
    if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        even_split(config.intermediate_size, probe[0], "intermediate_size")


def row_parallel(
    linear: nn.Linear, x: torch.Tensor, tp: TensorParallel, reduce: bool = True
) -> torch.Tensor:
    """A linear whose input columns are split across ranks: partial products summed by one
    all-reduce (or left partial, `reduce=False`, for a caller that sums more first); the bias
    counts once."""
    if not tp.live:
        return linear(x)
    if linear.weight is None:  # packed (models/quant): its shard of the input columns
        out = linear(x, add_bias=tp.rank == 0)
    else:
        out = F.linear(x, linear.weight, linear.bias if tp.rank == 0 else None)
    return tp.all_reduce(out) if reduce else out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows `[start, start + num_rows)` of the vocabulary (padded to an equal
    count per rank); ids outside them look up zeros, and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        per = -(-vocab_size // tp.size)
        self.tp = tp
        self.start = min(tp.rank * per, vocab_size)
        self.num_rows = min(per, vocab_size - self.start)
        self.weight = nn.Parameter(torch.empty(per, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        own = (local >= 0) & (local < self.num_rows)
        out = F.embedding(torch.where(own, local, 0), self.weight)
        out = out * own[:, None].to(out.dtype)
        return self.tp.all_reduce(out)


def sharded_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, width: int, tp: TensorParallel
) -> torch.Tensor:
    """RMSNorm over a row whose `width` columns are split across ranks (OLMoE's q/k norm)."""
    xf = x.float()
    sq = tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
    xf = xf * torch.rsqrt(sq / width + eps)
    return weight * xf.to(x.dtype)


@dataclass(frozen=True)
class Shard:
    """This rank's slice `[start, start + length)` along `dim` of a checkpoint tensor of
    shape `full`."""

    dim: int
    start: int
    length: int
    full: tuple[int, ...]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length)


def tensor_parallel_shards(
    model: DecoderForCausalLM,
) -> tuple[dict[str, Shard], dict[str, tuple[int, ...]]]:
    """Canonical HF name -> this rank's `Shard` of it, and the names (with full shapes) of
    tensors another rank owns (other ranks' experts), to be shape-checked and dropped."""
    cfg = model.config
    hidden = cfg.hidden_size
    shards: dict[str, Shard] = {}
    others: dict[str, tuple[int, ...]] = {}
    emb = model.embed_tokens
    vocab = Shard(0, emb.start, emb.num_rows, (cfg.vocab_size, hidden))
    shards["model.embed_tokens.weight"] = vocab
    shards["lm_head.weight"] = vocab  # dense, packed (models/quant) or absent (tied)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = layer.self_attn
        if hasattr(a, "kv_b_proj"):
            _mla_shards(shards, p + "self_attn.", a, cfg)
        else:
            _attention_shards(shards, p + "self_attn.", a, cfg)
        mlp = layer.mlp
        if hasattr(mlp, "w13"):
            inter = cfg.moe_intermediate_size
            owned = range(mlp.expert_start, mlp.expert_start + mlp.num_local_experts)
            biased = getattr(mlp, "w13_bias", None) is not None  # GPT-OSS
            for e in range(mlp.num_experts):
                if e not in owned:
                    q = p + f"mlp.experts.{e}."
                    others[q + "gate_proj.weight"] = (inter, hidden)
                    others[q + "up_proj.weight"] = (inter, hidden)
                    others[q + "down_proj.weight"] = (hidden, inter)
                    if biased:
                        others[q + "gate_proj.bias"] = (inter,)
                        others[q + "up_proj.bias"] = (inter,)
                        others[q + "down_proj.bias"] = (hidden,)
            if mlp.shared_expert is not None:
                _mlp_shards(shards, p + "mlp.shared_expert.", mlp.shared_expert, hidden)
            if getattr(mlp, "shared_experts", None) is not None:  # DeepSeek, GLM
                _mlp_shards(shards, p + "mlp.shared_experts.", mlp.shared_experts, hidden)
        else:
            _mlp_shards(shards, p + "mlp.", mlp, hidden)
    return shards, others


def _attention_shards(shards: dict[str, Shard], p: str, a: nn.Module, cfg: ModelConfig) -> None:
    hidden, q_full, kv_full = cfg.hidden_size, cfg.q_size, cfg.kv_size
    for kind in ("weight", "bias"):
        tail = (hidden,) if kind == "weight" else ()
        shards[p + f"q_proj.{kind}"] = Shard(0, a.q_start, a.q_size, (q_full, *tail))
        for name in ("k_proj", "v_proj"):
            shards[p + f"{name}.{kind}"] = Shard(0, a.kv_start, a.kv_size, (kv_full, *tail))
    shards[p + "o_proj.weight"] = Shard(1, a.q_start, a.q_size, (hidden, q_full))
    if a.qk_norm_full:
        shards[p + "q_norm.weight"] = Shard(0, a.q_start, a.q_size, (q_full,))
        shards[p + "k_norm.weight"] = Shard(0, a.kv_start, a.kv_size, (kv_full,))
    if a.sinks is not None:  # GPT-OSS: one per head
        h0 = a.q_start // a.head_dim
        shards[p + "sinks"] = Shard(0, h0, a.num_heads, (cfg.num_attention_heads,))


def _mla_shards(shards: dict[str, Shard], p: str, a: nn.Module, cfg: ModelConfig) -> None:
    """q (or q_b) and kv_b rows and o_proj columns of this rank's heads; the rest is whole."""
    heads, h0, n = cfg.num_attention_heads, a.head_start, a.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    kvb = cfg.qk_nope_head_dim + cfg.v_head_dim
    v = cfg.v_head_dim
    q_name, q_in = ("q_b_proj", cfg.q_lora_rank) if cfg.q_lora_rank else ("q_proj", cfg.hidden_size)
    shards[p + f"{q_name}.weight"] = Shard(0, h0 * qk, n * qk, (heads * qk, q_in))
    shards[p + "kv_b_proj.weight"] = Shard(0, h0 * kvb, n * kvb, (heads * kvb, cfg.kv_lora_rank))
    shards[p + "o_proj.weight"] = Shard(1, h0 * v, n * v, (cfg.hidden_size, heads * v))


def _mlp_shards(shards: dict[str, Shard], prefix: str, mlp: nn.Module, hidden: int) -> None:
    start, local, full = mlp.shard_start, mlp.intermediate_size, mlp.full_intermediate_size
    for name in ("gate_proj", "up_proj"):
        shards[prefix + f"{name}.weight"] = Shard(0, start, local, (full, hidden))
        shards[prefix + f"{name}.bias"] = Shard(0, start, local, (full,))
    shards[prefix + "down_proj.weight"] = Shard(1, start, local, (hidden, full))
