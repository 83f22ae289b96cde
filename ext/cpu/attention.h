// Causal attention over a paged KV cache on the CPU, one query row at a time: each row's
// scores, softmax and weighted sum run in one fixed order over exactly its own keys, so a row's
// output does not depend on the other rows, sequences or chunk sizes of the call (batch
// invariance). Plain C++: pointers in, no Python and no torch. Knows nothing about models.
#pragma once

#include <cstdint>

namespace tandem_cpu {

struct AttentionArgs {
  const void* q = nullptr;   // [T][H][D] fp32 or bf16, rows q_row_stride elements apart
  bool q_bf16 = false;
  int64_t q_row_stride = 0;  // 0: H * D (contiguous)
  void* out = nullptr;       // [T][H][D] fp32 or bf16, contiguous
  bool out_bf16 = false;
  // This step's keys and values [T][KVH][D] in the caches' dtype (rows *_row_stride elements
  // apart), written at slots[T] before any row attends; null: already in the caches.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t k_row_stride = 0, v_row_stride = 0;
  const int64_t* slots = nullptr;
  const void* k = nullptr;   // [num_blocks][block_size][KVH][D], bf16 or fp32
  const void* v = nullptr;
  bool kv_bf16 = true;
  int block_size = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int num_seqs = 0;
  const int64_t* q_starts = nullptr;  // [num_seqs] first row of each sequence in q
  const int64_t* q_lens = nullptr;    // [num_seqs]
  const int64_t* seq_lens = nullptr;  // [num_seqs] KV length, this step's rows included
  const int32_t* block_tables = nullptr;  // [num_seqs][max_blocks]
  int max_blocks = 0;
  float scale = 1.f;
};

// Throws std::invalid_argument on inconsistent sizes (a row past T, a KV length past the table,
// a slot past the cache).
void paged_attention_cpu(const AttentionArgs& a, int64_t num_tokens, int64_t num_blocks);

}  // namespace tandem_cpu
