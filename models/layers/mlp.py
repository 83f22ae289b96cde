"""The gated MLP of Llama/Qwen (and Qwen2-MoE's shared expert): down(silu(gate(x)) * up(x)).

gate and up are fused into one `gate_up_proj` `[2 * intermediate, hidden]` (gate rows first),
their biases likewise where the checkpoint has them (Llama's mlp_bias: gate, up and down).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import UnsupportedModelError


def check_activation(hidden_act: str) -> None:
    if hidden_act not in ("silu", "swish"):
        raise UnsupportedModelError(f"unsupported activation {hidden_act!r} (only silu)")


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        bias: bool = False,
    ) -> None:
        super().__init__()
        check_activation(hidden_act)
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate] each
        return self.down_proj(F.silu(gate) * up)
