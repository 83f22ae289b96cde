"""KTransformers' own CPU MoE kernels (PyPI kt-kernel, fetched by tools/peers/fetch_kt_kernel.sh)
as the peer of tools/bench_cpu_moe.py: the same layer, the same copies and routings, called the
way KTransformers' GPU-graph path calls it (inputs already in its pinned buffers, then one
synchronous CPU job), so the time is its CPU work alone. Needs CUDA: kt-kernel's buffers are
filled from device tensors. Not imported by the package or the tests.
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

# Tandem's pool format -> kt-kernel's inference method of the same weight bytes.
METHODS = {"bf16": "BF16", "int8": "AMXINT8", "int4": "AMXINT4"}


class KtMoeLayers:
    """`layers` copies of one MoE layer in kt-kernel; `forward` times one call."""

    def __init__(
        self,
        kt_dir: str,
        fmt: str,
        w13: torch.Tensor,  # [E, 2I, H] bf16: gate rows then up rows
        w2: torch.Tensor,  # [E, H, I] bf16
        top_k: int,
        layers: int,
        threads: int,
        max_tokens: int,
    ) -> None:
        if kt_dir not in sys.path:
            sys.path.insert(0, kt_dir)
        import kt_kernel
        from kt_kernel import KTMoEWrapper

        self.variant = getattr(kt_kernel, "__cpu_variant__", "?")
        self.method = METHODS[fmt]
        E, two_i, H = w13.shape
        inter = two_i // 2
        gate, up = w13[:, :inter].contiguous(), w13[:, inter:].contiguous()
        t0 = time.perf_counter()
        self.layers = []
        for layer in range(layers):
            w = KTMoEWrapper(
                layer_idx=layer,
                num_experts=E,
                num_experts_per_tok=top_k,
                hidden_size=H,
                moe_intermediate_size=inter,
                gpu_experts_mask=None,
                cpuinfer_threads=threads,
                threadpool_count=1,
                weight_path=tempfile.mkdtemp(prefix="kt-"),
                chunked_prefill_size=max(512, max_tokens),
                method=self.method,
            )
            w.load_weights_from_tensors(gate, up, w2.contiguous(), torch.arange(E))
            self.layers.append(w)
        self.convert_s = (time.perf_counter() - t0) / layers

    def forward(
        self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> float:
        """Seconds of kt-kernel's CPU job for hidden [T, H] routed to ids/weights [T, k]."""
        w = self.layers[layer]
        hs = hidden.to(torch.bfloat16).cuda()
        w.copy_inputs_to_cpu_buffers(hs, ids.cuda(), weights.float().cuda())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w.run_pinned_forward_sync(hs, 0)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.layers.clear()
