"""Checkpoint quantization formats served from their own bytes: GGUF blocks (tensor.py), GPTQ
and AWQ int4 (int4.py) and FP8 e4m3 (fp8.py, also the one FP8 reader of the dequantize-at-load
path), read as configured by hf_config.py; the linear and embedding layers that hold them (with
a pure-torch dequantize-then-matmul reference) and the swap of a model's dense modules for them
at load. Kernels live in ext/; cpu.py and cuda.py pick them."""
