"""Start-up memory profiling for the CUDA engine: the peak bytes one largest step needs
beyond the weights, so the KV pool can be sized from what is left. Knows nothing of serving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.models.batch import ForwardBatch, KVCache
from tandem.runtime.cuda_graphs import GRAPH_BATCH_SIZES
from tandem.runtime.cuda_sampler import CudaSampler, GpuRow
from tandem.runtime.token_counts import TokenCounts

if TYPE_CHECKING:
    from tandem.models.config import ModelConfig


@torch.inference_mode()
def profile_activation_bytes(
    model: torch.nn.Module,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_size: int,
) -> int:
    """Peak bytes a largest step needs beyond the weights: one prefill of the whole token
    budget (spread over up to `max_num_seqs` sequences, each sampling with top-p) through the
    model's own backend, on a throwaway KV cache; plus the decode graphs' static logits and
    the sampler's per-request token counts."""
    from tandem.runtime.sampling_params import SamplingParams

    num_tokens = max(max_num_batched_tokens, 1)
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    per_seq = -(-num_tokens // num_seqs)
    nb_per_seq = -(-per_seq // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    cache = KVCache.for_model(model_config, num_seqs * nb_per_seq, block_size, dtype, device)
    cache_bytes = torch.cuda.memory_allocated(device) - base
    lens = [min(per_seq, num_tokens - i * per_seq) for i in range(num_seqs)]
    lens = [n for n in lens if n > 0]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    total = qsl[-1]
    slots = torch.cat(
        [
            torch.arange(n, dtype=torch.int64) + i * nb_per_seq * block_size
            for i, n in enumerate(lens)
        ]
    )
    tables = torch.arange(len(lens) * nb_per_seq, dtype=torch.int32).view(len(lens), nb_per_seq)
    batch = ForwardBatch(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=slots.to(device),
        logits_indices=torch.tensor(qsl[1:], dtype=torch.int64, device=device) - 1,
        query_lens_cpu=lens,
        seq_lens_cpu=lens,
        kv_cache=cache,
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    ids = torch.randint(0, model_config.vocab_size, (total,), device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    logits = model.compute_logits(model(ids, positions, batch))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01)
    rows = [GpuRow(params, [0], 1, 0) for _ in range(logits.shape[0])]
    CudaSampler(device, len(rows)).sample_async(logits, rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - cache_bytes
    del cache, batch, logits
    torch.cuda.empty_cache()
    graph_logits = sum(GRAPH_BATCH_SIZES) * model_config.vocab_size * 4
    # the sampler's penalty state, allocated when a request first asks for penalties
    counts = TokenCounts.bytes_needed(max_num_seqs, model_config.vocab_size)
    return int(peak + graph_logits + counts + (256 << 20))
