"""Model building blocks: norm, rotary, attention, gated MLP, MoE routing and expert backends."""

from models.layers.attention import Attention
from models.layers.experts import (
    ExpertBackend,
    TorchExpertBackend,
    get_expert_backend,
    register_expert_backend,
)
from models.layers.mlp import GatedMLP
from models.layers.moe import SparseMoeBlock
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, rope_inv_freq

__all__ = [
    "Attention",
    "ExpertBackend",
    "GatedMLP",
    "RMSNorm",
    "RotaryEmbedding",
    "SparseMoeBlock",
    "TorchExpertBackend",
    "get_expert_backend",
    "register_expert_backend",
    "rope_inv_freq",
]
