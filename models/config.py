"""Model hyper-parameters, read from an HF `config.json` or from GGUF metadata.

`ModelConfig` is architecture-neutral: one frozen dataclass holds what every supported
family needs (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V2/V3,
Kimi-K2, GLM-4.5/4.6 and GPT-OSS). Loaders fill it; models read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
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
)
_GLM = "Glm4MoeForCausalLM"
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_DENSE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_OLMOE = "OlmoeForCausalLM"
_GPT_OSS = "GptOssForCausalLM"
# transformers' GptOssConfig default rope (YaRN over a 4096-token original context)
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

# transformers' own defaults (its config classes') for the keys a config.json may leave out, where
# they differ from the common ones below: a minimal config must mean what it means to transformers.
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 131072},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "head_dim": 128},
    "Qwen2MoeForCausalLM": {
        "max_position_embeddings": 32768,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
    },
    "Qwen3MoeForCausalLM": {
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
    },
    "MixtralForCausalLM": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 131072,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    _OLMOE: {
        "rms_norm_eps": 1e-5,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    },
    "DeepseekV2ForCausalLM": {
        "max_position_embeddings": 2048,
        "intermediate_size": 11008,
        "num_experts": 64,
        "moe_intermediate_size": 1407,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0,
        "topk_method": "greedy",
    },
    "DeepseekV3ForCausalLM": {
        "intermediate_size": 18432,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
    },
    # GLM-4.5 / 4.6 (transformers' Glm4MoeConfig defaults)
    _GLM: {
        "max_position_embeddings": 131072,
        "intermediate_size": 10944,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "rms_norm_eps": 1e-5,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.5,
    },
    _GPT_OSS: {
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "max_position_embeddings": 131072,
        "head_dim": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 2880,
        "num_experts": 128,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "attention_bias": True,
    },
}


def _default(arch: str, key: str) -> Any:
    """transformers' default for `key` in `arch`'s config (None: no default of its own)."""
    return _FAMILY_DEFAULTS.get(arch, {}).get(key, _COMMON_DEFAULTS.get(key))


class UnsupportedModelError(ValueError):
    """An architecture, tensor or quantization type Tandem cannot load; the message names it."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF's dict, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 4096
    # Sliding-window attention (HF: a key is seen while q_pos - k_pos < window) on the layers
    # `sliding_layers` names, where the checkpoint's own code windows them (_sliding_window):
    # Mistral, Mixtral, Qwen with use_sliding_window, GPT-OSS's alternate layers.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # GPT-OSS: a learned logit per head in every attention softmax (attention sinks); experts
    # with biases and the clamped SwiGLU (gate clamped above at swiglu_limit, up to
    # +-swiglu_limit, out = (up + 1) * gate * sigmoid(swiglu_alpha * gate)); a router bias.
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    moe_bias: bool = False
    tie_word_embeddings: bool = False
    # Biases, where transformers' code for the family has them (_biases): on q/k/v (Qwen2,
    # Qwen2-MoE; Llama, Qwen3 and Qwen3-MoE with attention_bias), on o_proj (Llama, Qwen3 and
    # Qwen3-MoE with attention_bias), on the dense MLP's gate/up/down (Llama with mlp_bias).
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # RMSNorm on q and k: per head (Qwen3), or with qk_norm_full over the whole projected q
    # (q_size wide) and k (kv_size wide) before the split into heads (OLMoE).
    qk_norm: bool = False
    qk_norm_full: bool = False
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to +-clip_qkv after the q/k norms
    hidden_act: str = "silu"
    # Mixture of experts (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeek MoE (models/deepseek.py): the first `first_k_dense_replace` layers dense, an
    # ungated shared expert of moe_intermediate_size * n_shared_experts, routing by
    # models/layers/moe_routing.py ("softmax" V2: greedy or group-limited by the max of a
    # group; "sigmoid" V3: e_score_correction_bias, groups by their top-2 sum), the top-k
    # weights times routed_scaling_factor.
    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (kv_lora_rank > 0; models/layers/mla.py). q_lora_rank 0: a
    # plain q_proj (DeepSeek-V2-Lite). head_dim is the rope part (qk_rope_head_dim), as in HF.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rope over (even, odd) pairs of the rope dims
    # Rotary on the first head_dim * partial_rotary_factor dims of q and k, the rest passed
    # through (GLM-4.5); 1.0 everywhere else.
    partial_rotary_factor: float = 1.0
    # Tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # as the checkpoint declares it
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def max_context(self) -> int:
        """The longest sequence Tandem computes as the checkpoint's own code would: the
        position limit (sliding windows are real windows, models/attention_backend.py)."""
        return self.max_position_embeddings

    @property
    def window_group_layers(self) -> tuple[int, ...]:
        """Windowed layers whose KV lives in a bounded pool of its own: where a model mixes
        windowed and full layers (GPT-OSS). Empty where every layer or none is windowed (an
        all-windowed model releases the blocks behind its window in the one pool)."""
        layers = self.sliding_layers
        if self.sliding_window and 0 < len(layers) < self.num_hidden_layers and not self.is_mla:
            return tuple(layers)
        return ()

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx`, None where it attends to everything."""
        return self.sliding_window if layer_idx in self.sliding_layers else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def latent_dim(self) -> int:
        """Values per token and layer of the latent KV cache (MLA): c_kv then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        if not self.is_moe or layer_idx in self.mlp_only_layers:
            return False
        if layer_idx < self.first_k_dense_replace:
            return False
        step = max(self.decoder_sparse_step, 1)
        return (layer_idx + 1) % step == 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(d.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = d["hidden_size"]
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # transformers >= 5 saves some families' num_experts as num_local_experts: either key
        num_experts = 0
        if arch not in _DENSE:
            default = _default(arch, "num_experts")
            keys = ("num_local_experts", "num_experts")  # DeepSeek's own key first
            keys = ("n_routed_experts", *keys) if arch in (*_DEEPSEEK, _GLM) else keys
            num_experts = _first(d, *keys, default=default)
        if arch in ("MixtralForCausalLM", _GPT_OSS):
            # Mixtral renormalizes the top-k weights; GPT-OSS's softmax over the top-k logits
            # is the same thing
            norm_topk = True  # transformers' Mixtral always renormalizes the top-k weights
        elif arch == "DeepseekV2ForCausalLM":
            norm_topk = False  # transformers' DeepSeek-V2 router never renormalizes
        else:
            norm_topk = bool(d.get("norm_topk_prob", _default(arch, "norm_topk_prob")))
        # Qwen2-MoE and Qwen3-MoE size their experts by moe_intermediate_size, Mixtral and OLMoE
        # by intermediate_size.
        if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", *_DEEPSEEK, _GLM):
            expert_inter = d.get("moe_intermediate_size", _default(arch, "moe_intermediate_size"))
        else:
            expert_inter = d.get("intermediate_size", _default(arch, "intermediate_size") or 0)
        qkv_bias, o_proj_bias, mlp_bias = _biases(arch, d)
        window, sliding_layers = _sliding_window(arch, d)
        sparse_step, mlp_only_layers = _moe_layers(arch, d)
        clip_qkv = d.get("clip_qkv") if arch == _OLMOE else None
        rope_scaling = d.get("rope_scaling")
        if arch == _GPT_OSS and rope_scaling is None and d.get("rope_parameters") is None:
            rope_scaling = dict(_GPT_OSS_ROPE)
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")  # transformers >= 5 moves rope settings here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d.get("intermediate_size", _default(arch, "intermediate_size")) or 0,
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=(
                d.get("num_key_value_heads") or _default(arch, "num_key_value_heads") or heads
            ),
            head_dim=_head_dim(arch, d),
            rms_norm_eps=d.get("rms_norm_eps", _default(arch, "rms_norm_eps")),
            rope_theta=float(
                rope_theta if rope_theta is not None else _default(arch, "rope_theta")
            ),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get(
                "max_position_embeddings", _default(arch, "max_position_embeddings")
            ),
            sliding_window=window,
            sliding_layers=sliding_layers,
            attention_sinks=arch == _GPT_OSS,
            swiglu_limit=(
                float(d.get("swiglu_limit", _default(arch, "swiglu_limit")))
                if arch == _GPT_OSS
                else None
            ),
            swiglu_alpha=float(d.get("swiglu_alpha", _default(arch, "swiglu_alpha") or 1.702)),
            moe_bias=arch == _GPT_OSS,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=arch.startswith("Qwen3")
            or arch == _OLMOE
            or (arch == _GLM and bool(d.get("use_qk_norm", False))),
            qk_norm_full=arch == _OLMOE,
            clip_qkv=float(clip_qkv) if clip_qkv is not None else None,
            hidden_act=d.get("hidden_act", "silu"),
            num_experts=num_experts,
            num_experts_per_tok=(
                d.get("num_experts_per_tok", _default(arch, "num_experts_per_tok")) or 0
                if num_experts
                else 0
            ),
            moe_intermediate_size=(expert_inter or 0) if num_experts else 0,
            shared_expert_intermediate_size=(
                d.get(
                    "shared_expert_intermediate_size",
                    _default(arch, "shared_expert_intermediate_size"),
                )
                or 0
                if arch == "Qwen2MoeForCausalLM"
                else 0
            ),
            norm_topk_prob=norm_topk,
            decoder_sparse_step=sparse_step,
            mlp_only_layers=mlp_only_layers,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            **(_deepseek_fields(arch, d) if arch in _DEEPSEEK else {}),
            **(_glm_fields(d, rope_params) if arch == _GLM else {}),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_hf_dict(json.loads(path.read_text()))


def _head_dim(arch: str, d: dict[str, Any]) -> int:
    if arch in _DEEPSEEK:  # transformers sets head_dim to the rope part
        return int(d.get("qk_rope_head_dim") or _default(arch, "qk_rope_head_dim"))
    return (
        d.get("head_dim", _default(arch, "head_dim"))
        or d["hidden_size"] // d["num_attention_heads"]
    )


def _deepseek_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The MLA and DeepSeek-MoE fields as transformers' DeepseekV2/V3 code reads them: V3
    always routes by sigmoid + e_score_correction_bias in groups (its config's topk_method and
    scoring_func are not read), V2 by softmax, greedy or group-limited by `topk_method`; V2
    always applies rope to interleaved pairs, V3 where `rope_interleave` (default true)."""

    def get(key: str) -> Any:
        value = d.get(key)
        return _default(arch, key) if value is None else value

    v3 = arch == "DeepseekV3ForCausalLM"
    topk_method = "noaux_tc" if v3 else str(get("topk_method"))
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise UnsupportedModelError(f"unsupported DeepSeek topk_method {topk_method!r}")
    grouped = topk_method != "greedy"
    n_group = int(get("n_group") or 1) if grouped else 1
    topk_group = int(get("topk_group") or 1) if grouped else 1
    experts = _first(d, "n_routed_experts", "num_local_experts", "num_experts",
                     default=_default(arch, "num_experts"))  # fmt: skip
    if grouped and (experts % n_group or not 1 <= topk_group <= n_group):
        raise UnsupportedModelError(
            f"group-limited routing needs n_group ({n_group}) to divide the {experts} experts "
            f"and 1 <= topk_group ({topk_group}) <= n_group"
        )
    rope_interleave = bool(d.get("rope_interleave", True)) if v3 else True
    return {
        "first_k_dense_replace": int(get("first_k_dense_replace") or 0),
        "n_shared_experts": int(get("n_shared_experts") or 0),
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": topk_method,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": float(get("routed_scaling_factor")),
        "q_lora_rank": int(d.get("q_lora_rank", _default(arch, "q_lora_rank")) or 0),
        "kv_lora_rank": int(get("kv_lora_rank")),
        "qk_nope_head_dim": int(get("qk_nope_head_dim")),
        "qk_rope_head_dim": int(get("qk_rope_head_dim")),
        "v_head_dim": int(get("v_head_dim")),
        "rope_interleave": rope_interleave,
    }


def _glm_fields(d: dict[str, Any], rope_params: Any) -> dict[str, Any]:
    """GLM-4.5's MoE as transformers' Glm4Moe code computes it: DeepSeek-V3's router (sigmoid +
    e_score_correction_bias, groups by their top-2 sum, renormalized by `norm_topk_prob`, times
    `routed_scaling_factor`), shared experts, the first `first_k_dense_replace` layers dense;
    rotary on the first `partial_rotary_factor` of each head (rotate_half, not interleaved)."""

    def get(key: str) -> Any:
        value = d.get(key)
        return _default(_GLM, key) if value is None else value

    experts = int(_first(d, "n_routed_experts", "num_local_experts", default=128))
    n_group, topk_group = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise UnsupportedModelError(
            f"group-limited routing needs n_group ({n_group}) to divide the {experts} experts "
            f"and 1 <= topk_group ({topk_group}) <= n_group"
        )
    factor = d.get("partial_rotary_factor")
    if factor is None and isinstance(rope_params, dict):
        factor = rope_params.get("partial_rotary_factor")
    return {
        "first_k_dense_replace": int(get("first_k_dense_replace")),
        "n_shared_experts": int(get("n_shared_experts")),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": float(get("routed_scaling_factor")),
        "partial_rotary_factor": float(
            factor if factor is not None else get("partial_rotary_factor")
        ),
    }


def _sliding_window(arch: str, d: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers it applies to) by transformers' rules; (None, ()) where no layer has
    one: Mistral and Mixtral window every layer when `sliding_window` is set (Mistral's code
    ignores `layer_types`); the Qwen families only with `use_sliding_window`, then the layers
    `layer_types` names (Qwen3-MoE's code: every layer; when absent: Qwen2-MoE the
    even-indexed ones below `max_window_layers`, dense Qwen2/Qwen3 those from
    `max_window_layers` on); GPT-OSS the layers `layer_types` names (default: the
    even-indexed ones) with a window of 128 unless set. Llama and OLMoE have none."""
    layers = range(d["num_hidden_layers"])
    if arch == _GPT_OSS:
        window = d.get("sliding_window", _default(arch, "sliding_window"))
        types = d.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in layers
        ]
        sliding = tuple(i for i in layers if types[i] == "sliding_attention")
        return (int(window), sliding) if window and sliding else (None, ())
    window = d.get("sliding_window")
    if not window or arch in ("LlamaForCausalLM", _OLMOE):
        return None, ()
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return int(window), tuple(layers)
    if not d.get("use_sliding_window", False):
        return None, ()
    types = d.get("layer_types")
    if arch == "Qwen3MoeForCausalLM":
        types = ["sliding_attention" for _ in layers]
    elif types is None:
        below = d.get("max_window_layers", 28)
        if arch == "Qwen2MoeForCausalLM":
            types = ["sliding_attention" if i % 2 == 0 and i < below else "full" for i in layers]
        else:
            types = ["sliding_attention" if i >= below else "full" for i in layers]
    sliding = tuple(i for i in layers if types[i] == "sliding_attention")
    return (int(window), sliding) if sliding else (None, ())


def _biases(arch: str, d: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, dense MLP bias) as transformers' code for the family builds
    them: Qwen2 always q/k/v (its config has no switch); Qwen2-MoE q/k/v by `qkv_bias`
    (transformers >= 5; earlier `attention_bias` or always), never o_proj; Llama, Qwen3,
    Qwen3-MoE and OLMoE q/k/v and o_proj by `attention_bias`; Llama alone the MLP's, by
    `mlp_bias`; Mistral and Mixtral none, whatever keys the config carries."""
    if arch == "Qwen2ForCausalLM":
        return True, False, False
    if arch == _GLM:  # attention_bias on q/k/v; o_proj and the MLPs never
        return bool(d.get("attention_bias", False)), False, False
    if arch in _DEEPSEEK:  # attention_bias: q_a, kv_a and o_proj; mlp_bias (V2): every MLP
        attn = bool(d.get("attention_bias", False))
        return attn, attn, arch == "DeepseekV2ForCausalLM" and bool(d.get("mlp_bias", False))
    if arch == "Qwen2MoeForCausalLM":
        return bool(_first(d, "qkv_bias", "attention_bias", default=True)), False, False
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", _OLMOE):
        attn = bool(d.get("attention_bias", False))
        return attn, attn, arch == "LlamaForCausalLM" and bool(d.get("mlp_bias", False))
    if arch == _GPT_OSS:  # q/k/v and o_proj by attention_bias, on by default
        attn = bool(d.get("attention_bias", True))
        return attn, attn, False
    return False, False, False


def _moe_layers(arch: str, d: dict[str, Any]) -> tuple[int, tuple[int, ...]]:
    """(decoder_sparse_step, mlp_only_layers): the Qwen MoE families read both from the config;
    Mixtral's, OLMoE's and GPT-OSS's code put experts on every layer, whatever keys the config
    carries."""
    if arch in ("MixtralForCausalLM", _OLMOE, _GPT_OSS, *_DEEPSEEK, _GLM):
        return 1, ()
    return d.get("decoder_sparse_step", 1) or 1, tuple(d.get("mlp_only_layers", ()) or ())


def _first(d: dict[str, Any], *keys: str, default: Any) -> Any:
    """The first of `keys` that `d` sets (not None), else `default`: for keys transformers
    spells two ways (Qwen2-MoE's q/k/v bias `qkv_bias` from transformers 5, `attention_bias` or
    nothing before; the expert count `num_local_experts` or `num_experts`)."""
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def _arch_from_model_type(model_type: str | None) -> str:
    table = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "olmoe": _OLMOE,
        "deepseek_v2": "DeepseekV2ForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "kimi_k2": "DeepseekV3ForCausalLM",
        "glm4_moe": _GLM,
        "gpt_oss": _GPT_OSS,
    }
    if model_type not in table:
        raise UnsupportedModelError(f"unsupported model_type {model_type!r}")
    return table[model_type]
