"""Model building blocks: norm, rotary, attention, gated MLP, MoE routing and expert backends."""

from tandem.models.layers.attention import Attention
from tandem.models.layers.expert_registry import get_expert_backend, register_expert_backend
from tandem.models.layers.experts import ExpertBackend, TorchExpertBackend
from tandem.models.layers.mlp import GatedMLP
from tandem.models.layers.moe import SparseMoeBlock
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.rotary import RotaryEmbedding, rope_inv_freq

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
