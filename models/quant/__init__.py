"""Checkpoint quantization formats: FP8 block-scaled weights decoded on load (fp8.py), and GGUF
weights served from their own bytes: the packed tensor type, the linear and embedding layers
that hold it (with a pure-torch dequantize-then-matmul reference), the swap of a model's dense
modules for them at load. Kernels live in ext/; this package picks them."""
