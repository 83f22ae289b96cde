"""Prefill-sized MoE steps of the "cpu_pool" backend computed on the GPU from the pool's own
weights ("expert streaming"): the layer's packed expert bytes go over PCIe, are widened on the
GPU and multiplied there with grouped GEMMs.

Why: with many tokens a layer's experts are nearly all routed, and the CPU pool is compute-bound
(Qwen3-30B-A3B shape, int4, 2,048-token prompt: ~65 ms a layer on 14 cores), while moving the
whole layer's int4 experts to the GPU costs ~320 MB / 55 GB/s = 6 ms and the GEMMs well under a
millisecond on an H100. Decode steps keep the pool (a few experts a token: reading them in host
memory is cheaper than shipping them). llama.cpp offloads large batches of CPU-resident weights
to the GPU the same way.

Owns: page-locking the pool's shard regions (cudaHostRegister, once per layer), two device
staging slots for the raw bytes, a copy stream that fetches the next layer while the current one
computes, the widening buffers, and the grouped expert computation, with GPT-OSS's expert
biases and clamped SwiGLU where a layer has them. Knows nothing about requests; the backend
decides when a step goes this way (`CpuPoolExpertBackend`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.ext.cpu.layout import ShardLayout, split_shard
from tandem.models.layers.experts import ExpertBias

logger = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the expert cache's read-only mappings


def _cuda_runtime():
    """CuPy's CUDA runtime module (page-locking, raw-pointer copies); CuPy is only needed
    on CUDA."""
    from tandem.ext.cuda._loader import cupy_module

    return cupy_module().cuda.runtime


def _grouped_mm(
    a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor, state: dict
) -> torch.Tensor:
    """a [P, K] rows grouped by expert (group g = rows offs[g-1]:offs[g]), b_t [E, K, N] (a
    transposed view of [E, N, K]) -> [P, N]. torch._grouped_mm where this torch and device
    have it; else a loop over the experts (one host sync for the offsets)."""
    if state.get("grouped", True):
        try:
            return torch._grouped_mm(a, b_t, offs=offs)
        except (RuntimeError, NotImplementedError, AttributeError, TypeError) as e:
            state["grouped"] = False
            logger.warning("gpu prefill: torch._grouped_mm unavailable (%s); per-expert loop", e)
    out = torch.empty(a.shape[0], b_t.shape[2], dtype=a.dtype, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.matmul(a[start:end], b_t[g], out=out[start:end])
        start = end
    return out


@dataclass(frozen=True)
class ShardBias:
    """A layer's expert biases laid out like its shards: `b13` per shard [E, 2Is] f32 in the
    blocked row order (zero past the real columns), `b2` [E, H] f32 (added once, not per
    shard), and the activation taking (gate, up)."""

    b13: tuple[torch.Tensor, ...]
    b2: torch.Tensor
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def blocked_bias(b13: torch.Tensor, s: ShardLayout) -> torch.Tensor:
    """The gate/up biases [E, 2I] (gate then up) of shard `s`'s columns [i0, i0 + Iv), padded
    with zeros to Is and interleaved in blocks of 32 gate + 32 up as its w13 rows are:
    [E, 2Is] f32 on b13's device."""
    E, inter = b13.shape[0], b13.shape[1] // 2
    out = torch.zeros(E, s.Is // 32, 2, 32, dtype=torch.float32, device=b13.device)
    for half in range(2):
        cols = b13[:, half * inter + s.i0 : half * inter + s.i0 + s.Iv].float()
        flat = torch.zeros(E, s.Is, dtype=torch.float32, device=b13.device)
        flat[:, : s.Iv] = cols
        out[:, :, half] = flat.view(E, s.Is // 32, 32)
    return out.view(E, 2 * s.Is)


def shard_bias(bias: ExpertBias, shards: Sequence[ShardLayout], device: torch.device) -> ShardBias:
    """`bias` for the non-empty shards of a layer (the ones `experts_from_shards` gets)."""
    b13 = bias.b13.detach().to(device)
    return ShardBias(
        b13=tuple(blocked_bias(b13, s) for s in shards if s.Is),
        b2=bias.b2.detach().to(device, torch.float32),
        activation=bias.activation,
    )


def experts_from_shards(
    hidden: torch.Tensor,  # [T, H] model dtype
    topk_ids: torch.Tensor,  # [T, k] int64, -1 = skipped slot
    topk_weights: torch.Tensor,  # [T, k] float32
    shards: Sequence[
        tuple[torch.Tensor, torch.Tensor]
    ],  # per shard (w13 [E, 2Is, Hp], w2 [E, Hp, Is])
    state: dict | None = None,
    bias: ShardBias | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] float32 from shard matrices in the pool's
    blocked row order (ext/cpu/layout.py): gate/up rows come in blocks of 32 + 32, so the
    gate_up product is split by a view, not a copy; the shards' partial outputs add up. No
    host sync where torch._grouped_mm runs. `bias` (GPT-OSS): each shard's gate/up biases
    are added before its activation (padding columns stay zero: act(0, 0) = 0 for SiLU and
    the clamped SwiGLU), the down bias once per routed slot, all before the routing weight."""
    state = {} if state is None else state
    T, H = hidden.shape
    k = topk_ids.shape[1]
    w13_0 = shards[0][0]
    E, Hp, dtype = w13_0.shape[0], w13_0.shape[2], w13_0.dtype
    flat = topk_ids.reshape(-1)
    skip = flat < 0
    ids = torch.where(skip, torch.zeros_like(flat), flat)  # skipped slots: expert 0, weight 0
    wts = torch.where(skip, torch.zeros_like(topk_weights.reshape(-1)), topk_weights.reshape(-1))
    order = torch.argsort(ids, stable=True)  # [P] pairs grouped by expert
    offs = torch.cumsum(torch.bincount(ids, minlength=E), 0).to(torch.int32)  # [E]
    tok = order // k
    xs = hidden.to(dtype).index_select(0, tok)  # [P, H]
    if Hp > H:
        xs = F.pad(xs, (0, Hp - H))
    pair_ids = ids.index_select(0, order) if bias is not None else None  # [P]
    y = None
    for i, (w13, w2) in enumerate(shards):
        Is = w2.shape[2]
        gu = _grouped_mm(xs, w13.transpose(1, 2), offs, state).float()  # [P, 2Is]
        if bias is not None:
            gu = gu + bias.b13[i].index_select(0, pair_ids)
        g = gu.view(-1, Is // 32, 2, 32)
        if bias is None:
            act = F.silu(g[:, :, 0]) * g[:, :, 1]
        else:
            act = bias.activation(g[:, :, 0], g[:, :, 1])
        act = act.reshape(-1, Is).to(dtype)  # [P, Is]
        part = _grouped_mm(act, w2.transpose(1, 2), offs, state)[:, :H].float()  # [P, H]
        y = part if y is None else y + part
    if bias is not None:
        y = y + bias.b2.index_select(0, pair_ids)
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tok, y * wts.index_select(0, order).float()[:, None])
    return out


class GpuExpertPrefill:
    """Computes whole MoE layers on `device` from the pool's packed weights; see the module
    docstring. `run` is enqueued on the current stream and never waits on the host (apart
    from page-locking a layer's memory the first time it is used)."""

    def __init__(
        self,
        pool,
        layers: Sequence[int],
        device: torch.device,
        biases: dict[int, ExpertBias] | None = None,
    ) -> None:
        """`biases`: the layers whose experts carry biases and the clamped SwiGLU (GPT-OSS),
        as the pool took them (`CpuExpertPool.set_expert_act`)."""
        self.pool = pool
        self.biases = biases if biases is not None else {}  # the backend's own: kept current
        self._shard_bias: dict[int, ShardBias] = {}  # layer -> its biases on the device
        self.layers = sorted(layers)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._shards: dict[int, list[ShardLayout]] = {}
        self._host: dict[int, list[torch.Tensor]] = {}  # layer -> shard regions (CPU views)
        self._registered: list[int] = []  # host addresses page-locked by us
        self._slots: list[torch.Tensor] = []  # raw staging, 2 on CUDA
        self._slot_of: dict[int, int] = {}  # layer -> slot already fetched / being fetched
        self._next_slot = 0
        self._wide: dict[tuple, torch.Tensor] = {}  # widened weights, one per shape
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []
        self._freed = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []
        self._mm_state: dict = {}
        self.calls = 0
        self.h2d_bytes = 0
        self.register_seconds = 0.0
        self._hooked = False

    def layer_bytes(self, layer: int) -> int:
        """Bytes one call of the layer moves host -> device."""
        return sum(s.nbytes for s in self._layout(layer))

    def _layout(self, layer: int) -> list[ShardLayout]:
        shards = self._shards.get(layer)
        if shards is None:
            shards = self._shards[layer] = self.pool.layer_shards(layer)
        return shards

    def _host_regions(self, layer: int) -> list[torch.Tensor]:
        regions = self._host.get(layer)
        if regions is None:
            regions = [self.pool.shard_memory(s) for s in self._layout(layer)]
            if not self._hooked:  # let go before the pool unmaps anything we hold
                self.pool.on_unmap(self.release)
                self._hooked = True
            if self.cuda:
                t0 = time.perf_counter()
                for s in self._layout(layer):
                    self._register(s.ptr, s.nbytes)
                self.register_seconds += time.perf_counter() - t0
            self._host[layer] = regions
        return regions

    def _register(self, addr: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        from tandem.ext.cuda._loader import cupy_module

        rt = _cuda_runtime()
        with cupy_module().cuda.Device(self.device.index or 0):
            try:
                rt.hostRegister(addr, nbytes, _HOST_REGISTER_PORTABLE)
            except Exception:  # a read-only mapping (the expert cache): say so
                rt.hostRegister(addr, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_READ_ONLY)
        self._registered.append(addr)

    def _slot(self, i: int, nbytes: int) -> tuple[torch.Tensor, bool]:
        """Staging slot i with room for nbytes, and whether it was (re)allocated just now."""
        while len(self._slots) <= i:
            self._slots.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._slots[i].numel() >= nbytes:
            return self._slots[i], False
        if self.cuda:  # the copy stream may still be filling the old one
            self._copy_stream.synchronize()
        self._slots[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._slots[i], True

    def _fetch(self, layer: int, slot: int) -> None:
        """Enqueues the layer's regions into staging `slot` (CUDA: on the copy stream, after
        the last compute that read the slot)."""
        regions = self._host_regions(layer)
        buf, fresh = self._slot(slot, self.layer_bytes(layer))
        self._slot_of = {lay: s for lay, s in self._slot_of.items() if s != slot}
        self._slot_of[layer] = slot
        if not self.cuda:
            at = 0
            for r in regions:
                buf[at : at + r.numel()].copy_(r)
                at += r.numel()
            return
        rt = _cuda_runtime()
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(self._freed[slot])
            if fresh:  # memory the allocator handed out in the compute stream's order
                self._copy_stream.wait_stream(compute)
            at = 0
            for s in self._layout(layer):
                if s.nbytes:
                    rt.memcpyAsync(
                        buf.data_ptr() + at, s.ptr, s.nbytes, rt.memcpyHostToDevice,
                        self._copy_stream.cuda_stream,
                    )  # fmt: skip
                at += s.nbytes
            self._copied[slot].record(self._copy_stream)

    def _widen(self, raw: torch.Tensor, s: ShardLayout, index: int, dtype: torch.dtype):
        """Shard `index`'s (w13 [E, 2Is, Hp], w2 [E, Hp, Is]) as `dtype` on the device: views
        of the raw bytes for bf16 weights in a bf16 model, else widened into buffers of that
        shard's own, reused from layer to layer (the shards of one layer split I, so all of
        them together are one layer's worth)."""
        w13q, s13, w2q, s2 = split_shard(raw, s)
        if s.fmt == "bf16" and dtype == torch.bfloat16:
            return w13q.view(torch.bfloat16), w2q.view(torch.bfloat16)
        from tandem.ext.cuda import expert_dequant

        out = []
        for name, q, sc, shape in (
            ("w13", w13q, s13, (s.E, 2 * s.Is, s.Hp)),
            ("w2", w2q, s2, (s.E, s.Hp, s.Is)),
        ):
            key = (index, name, shape, dtype)
            buf = self._wide.get(key)
            if buf is None:
                buf = self._wide[key] = torch.empty(shape, dtype=dtype, device=self.device)
            if s.fmt == "bf16":
                buf.copy_(q.view(torch.bfloat16))
            else:
                expert_dequant.dequantize(q, sc, s.fmt, s.group, dtype, out=buf, packed=s.packed)
            out.append(buf)
        return out[0], out[1]

    @torch.no_grad()
    def run(
        self,
        layer: int,
        hidden: torch.Tensor,  # [T, H] model dtype, on self.device
        topk_ids: torch.Tensor,  # [T, k] int64
        topk_weights: torch.Tensor,  # [T, k] float32
    ) -> torch.Tensor:
        """The layer's experts for these tokens, [T, H] float32 on the device. Also starts
        fetching the next layer into the other slot, so its copy overlaps this layer's GEMMs
        and the attention in between."""
        slot = self._slot_of.get(layer)
        if slot is None:
            slot = self._next_slot
            self._fetch(layer, slot)
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            stream.wait_event(self._copied[slot])
        raw = self._slots[slot]
        del self._slot_of[layer]
        self._next_slot = 1 - slot
        i = self.layers.index(layer)
        if i + 1 < len(self.layers) and self.layers[i + 1] not in self._slot_of:
            # the other slot, once the GEMMs of the layer before this one are done with it
            self._fetch(self.layers[i + 1], self._next_slot)
        shards, at = [], 0
        for index, s in enumerate(self._layout(layer)):
            if s.Is:
                shards.append(self._widen(raw[at : at + s.nbytes], s, index, hidden.dtype))
            at += s.nbytes
        bias = self._bias(layer)
        y = experts_from_shards(hidden, topk_ids, topk_weights, shards, self._mm_state, bias)
        if self.cuda:
            self._freed[slot].record(stream)
        self.calls += 1
        self.h2d_bytes += self.layer_bytes(layer)
        return y

    def _bias(self, layer: int) -> ShardBias | None:
        if layer not in self.biases:
            return None
        sb = self._shard_bias.get(layer)
        if sb is None:
            sb = self._shard_bias[layer] = shard_bias(
                self.biases[layer], self._layout(layer), self.device
            )
        return sb

    def release(self) -> None:
        """Waits for the copies in flight and unpins the pool's memory; views, layouts and
        the prefetch are dropped (the next `run` pins and fetches again). The pool calls it
        before it unmaps a layer (`CpuExpertPool.on_unmap`)."""
        self._hooked = False
        if self.cuda:
            self._copy_stream.synchronize()
            rt = _cuda_runtime()
            for addr in self._registered:
                try:
                    rt.hostUnregister(addr)
                except Exception:  # noqa: BLE001 - best effort
                    logger.warning("gpu prefill: could not unpin %#x", addr)
        self._registered = []
        self._host.clear()
        self._shards.clear()
        self._shard_bias.clear()
        self._slot_of.clear()

    def close(self) -> None:
        """Releases the pool's memory and frees the device buffers."""
        self.release()
        self._slots = []
        self._wide.clear()
