"""Loading a model's experts into the cpu_pool backend: which layers the checkpoint loader may
leave unread, converting each layer's stacked weights into the pool's format (bf16, int8,
int4) or mapping its saved conversion from the expert cache, a GGUF's own blocks, and freeing
the torch copies so host memory holds the experts once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.models.layers.cpu_expert_options import (
    CONFINE_ENV,
    MXFP4_POOL_FORMAT,
    num_gpu_experts,
)
from tandem.models.layers.experts import ClampedSwiGLU, ExpertBias

if TYPE_CHECKING:
    from tandem.ext.cpu import CpuExpertPool, ExpertCache

logger = logging.getLogger(__name__)


def expert_bias_of(block: nn.Module) -> ExpertBias | None:
    """A MoE block's expert biases and activation (GPT-OSS's `w13_bias`, `w2_bias` and
    `activation`), else None (bias-free SiLU experts)."""
    b13, b2 = getattr(block, "w13_bias", None), getattr(block, "w2_bias", None)
    if b13 is None or b2 is None:
        return None
    if not isinstance(block.activation, ClampedSwiGLU):
        raise ValueError(f"cpu_pool: no kernel for the expert activation {block.activation!r}")
    return ExpertBias(b13, b2, block.activation)


def has_mxfp4_experts(checkpoint: Path) -> bool:
    """Whether a safetensors checkpoint stores its experts in MXFP4 (GPT-OSS's `_blocks` /
    `_scales`); reads the files' headers only."""
    from safetensors import safe_open

    from tandem.models.loader.safetensors import safetensors_files

    for file in safetensors_files(checkpoint):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if any(".experts." in name and name.endswith("_blocks") for name in f.keys()):  # noqa: SIM118
                return True
    return False


def _shape(w13: torch.Tensor) -> tuple[int, int, int]:
    """(E, I, H) of a stacked w13 `[E, 2I, H]`."""
    return w13.shape[0], w13.shape[1] // 2, w13.shape[2]


class PoolLoading:
    """Mixin of CpuPoolExpertBackend (cpu_experts.py), over its pool, options and tables."""

    pool: CpuExpertPool

    def _blocks(self, model: nn.Module) -> list[nn.Module]:
        return [
            block
            for block in model.modules()
            if hasattr(block, "w13") and hasattr(block, "layer_idx") and block.backend is self
        ]

    def skip_expert_layers(
        self, model: nn.Module, checkpoint: str | Path, checkpoint_format: str
    ) -> frozenset[int]:
        """Asked by the loader before it reads any weight: the MoE layers whose routed-expert
        tensors it need not read. Those are the layers whose expert-cache entry passes its
        header check (no weight is mapped or read), and, for a GGUF file, every layer with
        stacked experts (`add_block` converts them from the file's own blocks). `attach` then
        maps or converts them; it must be given `read_experts` in case an entry has gone bad
        in between. Records `checkpoint` as the cache's source identity. For safetensors,
        every other layer too: `attach` reads each right before converting it, so one layer's
        host copy exists at a time (a 671B checkpoint's experts never fit at once). For random
        weights ("dummy") every layer: `read_experts` fills each right before it is converted,
        and nothing is cached."""
        checkpoint = Path(checkpoint)
        self._skipped = set()
        if checkpoint_format == "dummy":
            self._cache_option = False
            self._skipped = {block.layer_idx for block in self._blocks(model)}
            return frozenset(self._skipped)
        if checkpoint_format == "gguf":
            from tandem.models.gguf_reader import GGUFReader
            from tandem.models.loader.gguf_experts import gguf_expert_layers

            self.gguf_source = checkpoint
            self._gguf_layers = frozenset(gguf_expert_layers(GGUFReader(checkpoint)))
        elif self.cache_source is None:
            self.cache_source = checkpoint
        if (
            self.fmt == "auto"
            and checkpoint_format == "safetensors"
            and has_mxfp4_experts(checkpoint)
        ):
            self.fmt = MXFP4_POOL_FORMAT  # before the cache picks its directory by format
        blocks = list(self._blocks(model))
        cache = self._expert_cache(dtype=blocks[0].w13.dtype if blocks else None)
        for block in blocks:
            layer, w13, w2 = block.layer_idx, block.w13, block.w2
            if layer in self._gguf_layers or (
                cache is not None
                and cache.check(layer, self._layer_key(cache, layer, w13, w2), _shape(w13))
            ):
                self._skipped.add(layer)
            elif checkpoint_format == "safetensors":
                # read right before its conversion (attach): one layer's copy at a time
                self._skipped.add(layer)
        return frozenset(self._skipped)

    @torch.no_grad()
    def attach(self, model: nn.Module, read_experts: Callable[[int], None] | None = None) -> None:
        """Moves every MoE block's experts into the pool (converting them, or mapping them
        from the expert cache) and frees the torch copies; keeps each layer's first `gpu`
        experts on the model's device until routing counts say which are hottest
        (`rebalance`). `read_experts(layer)` fills a block's w13/w2 from the checkpoint: the
        fall-back for a layer `skip_expert_layers` left unread whose cache entry went bad."""
        t0 = time.perf_counter()
        for block in self._blocks(model):
            self.add_block(block, read_experts)
        self._t_attach = time.perf_counter()
        if self._num_experts:
            self.confine()
            info = self.pool.info()
            logger.info(
                "cpu_pool: %d MoE layers (%s, %.2f GB) in %.1fs (reading %.1fs, converting "
                "%.1fs), kernels %s/%s%s, %d threads on %d NUMA node(s)%s, %d experts a layer on "
                "the GPU",
                len(info["layers"]),
                "+".join(sorted(info["bytes_per_format"])),
                sum(info["bytes_per_format"].values()) / 1e9,
                self._t_attach - t0,
                self._load_s["read"],
                self._load_s["convert"],
                info["isa"],
                info["int_isa"] or "-",
                ", packed rows" if info["pack_rows"] else "",
                info["num_threads"],
                len(info["numa_nodes"]),
                f", sync {self.sync}" if self._on_cuda else "",
                num_gpu_experts(
                    max(self._num_experts.values()), self.cpu_experts, self.gpu_experts
                ),
            )

    def confine(self) -> list[int]:
        """On CUDA (unless TANDEM_POOL_CONFINE=off): every thread of the process but the pool's
        pinned ones onto the cpus the workers leave, and torch's CPU threads to that many;
        called by `attach` once the experts are in. A decode step waits on the slowest worker
        of each layer's job, and an unpinned thread of the server (the event loop, the
        scheduler, the CUDA driver) landing on a worker's core delays that job by a time slice
        (Qwen3-30B-A3B shape, int4, `tandem serve` on the H100 machine, same call: batch-1
        decode 58.4 tok/s unconfined, 64.1 confined; docs/BENCHMARKS.md). Returns the cpus,
        empty where nothing changed."""
        from tandem.ext.cpu.pool import switch_from_env

        if not self._on_cuda or switch_from_env(CONFINE_ENV) is False:
            return []
        cpus = self.pool.confine_others()
        if cpus:
            if self._torch_threads is None:
                self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(len(cpus))
            logger.info("cpu_pool: the process's other threads confined to cpus %s", cpus)
        return cpus

    @torch.no_grad()
    def add_block(
        self, block: nn.Module, read_experts: Callable[[int], None] | None = None
    ) -> None:
        layer, w13, w2 = block.layer_idx, block.w13, block.w2
        # the router and the shared expert live on the model's device (the pool's thread count
        # depends on it; decided before the first access to `pool` below)
        self._on_cuda = self._on_cuda or any(p.is_cuda for p in block.parameters())
        E = w13.shape[0]
        device = block.gate.weight.device
        unread = layer in self._skipped  # the loader left w13/w2 uninitialized
        cache = self._expert_cache(None if unread else (w13, w2), w13.dtype)
        key = self._layer_key(cache, layer, w13, w2) if cache is not None else ""
        if cache is None or not cache.load(self.pool, layer, key, _shape(w13)):
            if layer in self._gguf_layers:  # from the file's own blocks, decoded to fp32
                from tandem.models.loader.gguf_experts import load_gguf_experts

                load_gguf_experts(
                    self.gguf_source, self.pool, self.fmt, [layer], self._group_option
                )
            else:
                if unread:
                    if read_experts is None:
                        raise RuntimeError(
                            f"cpu_pool: layer {layer}'s experts were not read and its cache "
                            "entry is unusable; attach needs read_experts"
                        )
                    if cache is not None:
                        logger.warning(
                            "expert cache: re-reading layer %d's experts from the checkpoint",
                            layer,
                        )
                    t_read = time.perf_counter()
                    read_experts(layer)
                    self._load_s["read"] += time.perf_counter() - t_read
                    w13, w2 = block.w13, block.w2
                fmt = "bf16" if self.fmt == "auto" else self.fmt
                w13_h, w2_h = w13.detach().cpu(), w2.detach().cpu()
                t_convert = time.perf_counter()
                self.pool.add_layer(layer, w13_h, w2_h, fmt, self.group_size)
                self._load_s["convert"] += time.perf_counter() - t_convert
            if cache is not None:
                cache.save(self.pool, layer, key)
        bias = expert_bias_of(block)
        if bias is not None:
            self._biases[layer] = bias
            act = bias.activation
            self.pool.set_expert_act(
                layer, bias.b13.detach().cpu(), bias.b2.detach().cpu(), (act.alpha, act.limit)
            )
        self._num_experts[layer] = E
        self._counts[layer] = torch.zeros(E, dtype=torch.int64, device=device)
        gpu = num_gpu_experts(E, self.cpu_experts, self.gpu_experts)
        if gpu:
            self._place(layer, torch.arange(gpu), w13.dtype, device)
        # Free the torch copies: the pool holds the experts now.
        empty13 = torch.empty(E, 0, w13.shape[2], dtype=w13.dtype, device=w13.device)
        empty2 = torch.empty(E, w2.shape[1], 0, dtype=w2.dtype, device=w2.device)
        block.w13 = nn.Parameter(empty13, requires_grad=False)
        block.w2 = nn.Parameter(empty2, requires_grad=False)

    def _layer_key(
        self, cache: ExpertCache, layer: int, w13: torch.Tensor, w2: torch.Tensor
    ) -> str:
        """Besides shapes, what the converted bytes depend on: nothing more for a GGUF layer
        (converted from the file's blocks), the dtype the loader casts a checkpoint to, or,
        without a checkpoint file, a sampled fingerprint of the weights themselves."""
        if layer in self._gguf_layers:
            weights_id = "gguf"
        elif self.gguf_source is not None or self.cache_source is not None:
            weights_id = f"file:{w13.dtype}"
        else:
            from tandem.ext.cpu.cache import weights_fingerprint

            weights_id = f"weights:{weights_fingerprint(w13, w2)}"
        return cache.layer_key(layer, tuple(w13.shape), tuple(w2.shape), weights_id)

    def _expert_cache(
        self,
        weights: tuple[torch.Tensor, torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
    ) -> ExpertCache | None:
        """The cache of this model, made at the first call (None when off or unwritable, or
        when there is neither a checkpoint file nor `weights` to key it by). A checkpoint
        loaded in another dtype (`dtype`, what the loader casts the experts to) converts to
        other bytes, so it gets its own directory: runs in float32 and bf16 keep one each
        instead of overwriting each other."""
        if self._cache is not None or self._cache_option is False:
            return self._cache
        from tandem.ext.cpu import ExpertCache, default_cache_root, source_identity
        from tandem.ext.cpu.cache import weights_fingerprint

        src = self.gguf_source or self.cache_source
        if src is None and weights is None:
            return None
        if self._cache_option is None or self._cache_option is True:
            root = default_cache_root()
        else:
            root = Path(self._cache_option)
        if root is None:
            self._cache_option = False
            return None
        if src is None:
            source = f"weights:{weights_fingerprint(*weights)}"
        elif self.gguf_source is None and dtype is not None:
            source = f"file:{source_identity(src)}:{dtype}"
        else:  # GGUF experts convert from the file's own blocks, whatever the model's dtype
            source = f"file:{source_identity(src)}"
        # "auto" converts float weights to bf16: one entry for both spellings, not two copies
        # of the same bytes (a GGUF's "auto" keeps each layer's own format, so stays "auto")
        fmt = "bf16" if self.fmt == "auto" and self.gguf_source is None else self.fmt
        self._cache = ExpertCache(root, source, fmt, self.group_size)
        return self._cache
