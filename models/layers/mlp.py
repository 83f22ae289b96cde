"""The gated MLP of Llama/Qwen (and Qwen2-MoE's shared expert): down(silu(gate(x)) * up(x)).

gate and up are fused into one `gate_up_proj` `[2 * intermediate, hidden]` (gate rows first),
their biases likewise where the checkpoint has them (Llama's mlp_bias: gate, up and down).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.config import UnsupportedModelError
from tandem.models.layers.parallel import even_split, get_tp, row_parallel


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
        reduce: bool = True,
    ) -> None:
        """Under tensor parallelism each rank holds a slice of the intermediate rows; its
        output is summed over ranks by one all-reduce, or left partial (`reduce=False`) for a
        caller that sums more first."""
        super().__init__()
        check_activation(hidden_act)
        self.tp = get_tp()
        self.reduce = reduce
        self.full_intermediate_size = intermediate_size
        self.shard_start, intermediate_size = even_split(
            intermediate_size, self.tp, "intermediate size"
        )
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate] each
        return row_parallel(self.down_proj, F.silu(gate) * up, self.tp, self.reduce)
