"""Checkpoint quantization formats decoded on load (FP8 block-scaled weights)."""
