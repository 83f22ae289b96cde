"""KTransformers' own CPU MoE kernels (PyPI kt-kernel, fetched by tools/peers/fetch_kt_kernel.sh)
as the peer of tools/bench_cpu_moe.py: the same layer, the same copies and routings, called the
way KTransformers' GPU-graph path calls it (inputs already in its pinned buffers, then one
synchronous CPU job), so the time is its CPU work alone. Needs CUDA: kt-kernel's buffers are
filled from device tensors. Not imported by the package or the tests.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import torch

# Tandem's pool format -> kt-kernel's inference method of the same weight bytes.
METHODS = {"bf16": "BF16", "int8": "AMXINT8", "int4": "AMXINT4"}


class _TensorExperts:
    """Stands in for kt-kernel's safetensors loader: its BF16 method loads experts only through
    a loader (`load_experts(base_key)` -> per-expert gate/up/down tensors), never from tensors."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.experts = {"gate": list(gate), "up": list(up), "down": list(down)}

    def load_experts(self, base_key: str, device: str = "cpu") -> dict[str, list[torch.Tensor]]:
        return self.experts

    def close_all_handles(self) -> None:
        pass


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
        from kt_kernel.utils.amx import NativeMoEWrapper

        self.variant = getattr(kt_kernel, "__cpu_variant__", "?")
        self.method = METHODS[fmt]
        E, two_i, H = w13.shape
        inter = two_i // 2
        gate, up = w13[:, :inter].contiguous(), w13[:, inter:].contiguous()
        down = w2.contiguous()
        # AMXINT4/8 write their quantized copy under weight_path: RAM, not the disk, if it can
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.tmp = tempfile.mkdtemp(prefix="kt-", dir=shm)
        t0 = time.perf_counter()
        self.layers = []
        for layer in range(layers):
            if self.method == "BF16":  # read once per wrapper, then released by kt-kernel
                NativeMoEWrapper._native_loader_instance = _TensorExperts(gate, up, down)
            w = KTMoEWrapper(
                layer_idx=layer,
                num_experts=E,
                num_experts_per_tok=top_k,
                hidden_size=H,
                moe_intermediate_size=inter,
                gpu_experts_mask=None,
                cpuinfer_threads=threads,
                threadpool_count=1,
                weight_path=tempfile.mkdtemp(dir=self.tmp),
                chunked_prefill_size=max(512, max_tokens),
                method=self.method,
            )
            if self.method == "BF16":
                NativeMoEWrapper._native_loader_instance = _TensorExperts(gate, up, down)
                w.load_weights(torch.arange(E))
            else:
                w.load_weights_from_tensors(gate, up, down, torch.arange(E))
            self.layers.append(w)
        self.convert_s = (time.perf_counter() - t0) / layers

    @staticmethod
    def stage(
        hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One call's inputs on the GPU, where kt-kernel's graph path finds them: made once
        per routing, so no CPU-side torch work (whose OpenMP threads spin on after it) runs
        just before a timed call."""
        return hidden.to(torch.bfloat16).cuda(), ids.cuda(), weights.float().cuda()

    def forward(self, layer: int, staged: tuple[torch.Tensor, ...]) -> float:
        """Seconds of kt-kernel's CPU job for staged hidden [T, H], ids / weights [T, k]."""
        w = self.layers[layer]
        hs, ids, weights = staged
        w.copy_inputs_to_cpu_buffers(hs, ids, weights)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w.run_pinned_forward_sync(hs, 0)
        elapsed = time.perf_counter() - t0
        self.last = (w, hs)
        return elapsed

    def last_output(self) -> torch.Tensor:
        """[T, H] fp32: the output of the last `forward` (its pinned output buffer)."""
        from kt_kernel.experts_base import KExpertsCPUBuffer

        w, hs = self.last
        output_cpu = KExpertsCPUBuffer.get_buffer(hs, w.num_experts_per_tok)[4]
        return output_cpu[w.layer_idx % KExpertsCPUBuffer.buffer_depth].float().clone()

    def close(self) -> None:
        self.layers.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
