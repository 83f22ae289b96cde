"""Upcycle a dense Llama-family model (default: SmolLM2, the default GGUF) into a
Mixtral-architecture HF safetensors directory that computes the same function.

Each layer's MLP (gate/up `[I, H]`, down `[H, I]`) is split along its intermediate dimension
into E experts of I/E columns. The router weights are zero, so softmax gives every expert 1/E
and top-k = E picks them all; each expert's down projection is scaled by E, so
sum_e (1/E) * E * down_e(SiLU(gate_e x) * up_e x) = down(SiLU(gate x) * up x), the dense MLP.
With E a power of two the scaling is exact in any float format.

    python tools/upcycle_moe.py OUT_DIR [--model PATH] [--experts 8] [--dtype bfloat16]

Writes config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with the chat template). Never imported by the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.app.engine_args import count_arg  # noqa: E402
from tandem.models.config import ModelConfig  # noqa: E402
from tandem.models.hf_export import to_hf_config_dict  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def moe_config(dense: ModelConfig, num_experts: int) -> ModelConfig:
    if dense.is_moe:
        raise ValueError(f"{dense.architecture} is already a mixture of experts")
    biases = [n for n in ("attention_bias", "o_proj_bias", "mlp_bias") if getattr(dense, n, False)]
    if biases:  # Mixtral has none of them: they would be dropped silently
        raise ValueError(
            f"{dense.architecture} with {', '.join(biases)}: Mixtral has no such biases, so the "
            "upcycled model could not compute the dense one"
        )
    if num_experts < 1:
        raise ValueError(f"--experts must be at least 1, got {num_experts}")
    if dense.intermediate_size % num_experts:
        raise ValueError(
            f"intermediate size {dense.intermediate_size} is not divisible by {num_experts}"
        )
    return dataclasses.replace(
        dense,
        architecture="MixtralForCausalLM",
        num_experts=num_experts,
        num_experts_per_tok=num_experts,
        moe_intermediate_size=dense.intermediate_size // num_experts,
        norm_topk_prob=True,
    )


def split_mlp(
    layer: int,
    gate: torch.Tensor,  # [I, H]
    up: torch.Tensor,  # [I, H]
    down: torch.Tensor,  # [H, I]
    num_experts: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """One dense MLP -> Mixtral's router and per-expert w1 (gate), w3 (up), w2 (down)."""
    p = f"model.layers.{layer}.block_sparse_moe."
    inter = gate.shape[0] // num_experts
    yield p + "gate.weight", torch.zeros(num_experts, gate.shape[1], dtype=gate.dtype)
    for e in range(num_experts):
        cols = slice(e * inter, (e + 1) * inter)
        yield p + f"experts.{e}.w1.weight", gate[cols].contiguous()
        yield p + f"experts.{e}.w3.weight", up[cols].contiguous()
        yield p + f"experts.{e}.w2.weight", (down[:, cols] * num_experts).contiguous()


def upcycle_weights(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named dense weights -> HF-named Mixtral weights (everything else passes through)."""
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        m = _MLP.match(name)
        if m is None:
            yield name, tensor
            continue
        layer = int(m[1])
        parts = pending.setdefault(layer, {})
        parts[m[2]] = tensor
        if len(parts) == 3:
            del pending[layer]
            yield from split_mlp(
                layer, parts["gate_proj"], parts["up_proj"], parts["down_proj"], num_experts
            )
    if pending:
        raise ValueError(f"incomplete MLP tensors for layers {sorted(pending)}")


def _dense_source(model: Path):
    """(ModelConfig, weight iterator, Tokenizer) of a .gguf file or an HF directory."""
    from tandem.models.tokenizer import Tokenizer

    if model.suffix == ".gguf":
        from tandem.models.loader.gguf import gguf_model_config, load_gguf_weights

        return gguf_model_config(model), load_gguf_weights(model), Tokenizer.from_gguf(model)
    from tandem.models.loader.safetensors import iter_safetensors_weights

    cfg = ModelConfig.from_pretrained(model)
    return cfg, iter_safetensors_weights(model, torch.float32), Tokenizer.from_pretrained(model)


def write_tokenizer(tok, out: Path, max_len: int) -> None:
    tok.backend.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "unk_token": tok.unk_token,
        "pad_token": tok.pad_token,
        "add_bos_token": tok.add_bos_token,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def upcycle(
    out: Path,
    model: Path | None = None,
    num_experts: int = 8,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Writes the Mixtral directory `out` from `model` (default: the default model)."""
    if model is None:
        from tandem.models.hub import resolve_model

        model = resolve_model(None)
    dense_cfg, weights, tok = _dense_source(Path(model))
    cfg = moe_config(dense_cfg, num_experts)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in upcycle_weights(weights, num_experts):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        tensors[name] = tensor.to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = to_hf_config_dict(cfg)
    dtype_name = str(dtype).removeprefix("torch.")
    hf.update(
        router_jitter_noise=0.0,
        output_router_logits=False,
        sliding_window=None,
        torch_dtype=dtype_name,
    )
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": hf["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_tokenizer(tok, out, cfg.max_position_embeddings)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--model", type=Path, default=None, help="dense .gguf or HF dir (default model)")
    p.add_argument("--experts", type=count_arg(1), default=8)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    args = p.parse_args(argv)
    try:
        path = upcycle(args.out, args.model, args.experts, _DTYPES[args.dtype])
    except (ValueError, OSError) as e:  # bad --experts, a missing model, an unwritable out
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
