"""How much the CPU pool's int8 activation quantization costs on a real model's MLP inputs.

Runs a prompt through the model (any dense or MoE checkpoint Tandem loads; default: the bundled
SmolLM2-135M-Instruct), captures the input of every dense MLP (post-norm hidden states: real
outlier channels, unlike random tests), and computes each layer's MLP output in float32 with
its two inputs (the gate/up input and the down input) quantized to int8 as the integer path
does: per token and 32-element block (VNNI, and the AMX tiles on int4 weights), with one scale
per token row (what the AMX tiles did from 16 tokens an expert in session 8), or per row with 16
bits (row16: the AMX tiles on packed int8 weights since session 10).
Prints the relative L2 error of the MLP output per layer and on average. Weights stay exact,
so only the activations' share of the error shows.

    python tools/act_quant_error.py [--model PATH] [--load-format auto|dummy] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ext.cpu.reference import quantize_activations, quantize_activations_row16  # noqa: E402
from tandem.models.layers.mlp import GatedMLP  # noqa: E402
from tandem.runtime import LLM, SamplingParams  # noqa: E402
from tandem.runtime.config import EngineConfig, ModelSpec  # noqa: E402

TEXT = (
    "The history of the Roman Empire spans more than a thousand years. It began when Augustus "
    "became the first emperor in 27 BC and, in the West, ended in 476 AD. Its legacy includes "
    "law, language, architecture and roads that still shape Europe. "
)


def mlp_out(m: GatedMLP, x: torch.Tensor, quant=None) -> torch.Tensor:
    q = quant or (lambda t: t)
    gate, up = (q(x) @ m.gate_up_proj.weight.float().t()).chunk(2, dim=-1)
    return q(F.silu(gate) * up) @ m.down_proj.weight.float().t()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--repeat", type=int, default=3, help="copies of the built-in paragraph")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    spec = ModelSpec(model=a.model, load_format=a.load_format, device="cpu", dtype="float32")
    llm = LLM(engine_config=EngineConfig(model=spec))
    mlps = [m for m in llm.engine.model.modules() if isinstance(m, GatedMLP)]
    if not mlps:
        raise SystemExit("no dense MLP in this model to capture")
    captured: dict[int, torch.Tensor] = {}

    def hook(i: int):
        return lambda mod, args: captured.setdefault(i, args[0].detach().float().clone())

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(mlps)]
    llm.generate([TEXT * a.repeat], SamplingParams(max_tokens=1, temperature=0.0))
    for h in handles:
        h.remove()
    schemes = {
        "block32": quantize_activations,
        "row": lambda t: quantize_activations(t, block=t.shape[-1]),
        "row16": quantize_activations_row16,
    }
    rows = []
    print("layer tokens  absmax/rms  rel err: per 32-block   per row   row16")
    for i, x in sorted(captured.items()):
        ref = mlp_out(mlps[i], x)
        err = {
            k: float((mlp_out(mlps[i], x, q) - ref).norm() / ref.norm()) for k, q in schemes.items()
        }
        peak = float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).median())
        rows.append({"layer": i, "tokens": x.shape[0], "absmax_over_rms": peak, **err})
        print(
            f"{i:5d} {x.shape[0]:6d} {peak:11.1f} {err['block32']:20.4f} {err['row']:9.4f}"
            f" {err['row16']:9.6f}"
        )
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in schemes}
    print(f"mean: per 32-block {mean['block32']:.4f}, per row {mean['row']:.4f}, "
          f"row16 {mean['row16']:.6f} (max {max(r['block32'] for r in rows):.4f} / "
          f"{max(r['row'] for r in rows):.4f} / {max(r['row16'] for r in rows):.6f})")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"layers": rows, "mean": mean}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
