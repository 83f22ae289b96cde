#include "attention.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels.h"

namespace tandem_cpu {
namespace {

constexpr int kLanes = 16;  // partial sums of a dot product: a fixed order, vectorizable

inline float bf16_value(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One KV row [D] as fp32 into dst (bf16 widened exactly).
inline const float* kv_row(const AttentionArgs& a, const void* base, const int32_t* table, int j,
                           int kvh, float* dst) {
  const int64_t slot = (int64_t)table[j / a.block_size] * a.block_size + j % a.block_size;
  const int64_t at = (slot * a.num_kv_heads + kvh) * a.head_dim;
  if (!a.kv_bf16) return (const float*)base + at;
  const uint16_t* src = (const uint16_t*)base + at;
  for (int d = 0; d < a.head_dim; ++d) dst[d] = bf16_value(src[d]);
  return dst;
}

inline float dot(const float* __restrict x, const float* __restrict y, int n) {
  float part[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += x[d + l] * y[d + l];
  for (int l = 0; d < n; ++d, ++l) part[l] += x[d] * y[d];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

// The G query heads of KV head `kvh` at one row (position pos) against keys [0, pos]:
// scores, max, exp and the weighted sum of V, each in key order.
__attribute__((target_clones("avx512f", "avx2", "default"))) void attend(
    const AttentionArgs& a, const float* q, int pos, int kvh, const int32_t* table,
    float* scores, float* acc, float* kbuf) {
  const int G = a.num_heads / a.num_kv_heads, D = a.head_dim, n = pos + 1;
  for (int j = 0; j < n; ++j) {
    const float* k = kv_row(a, a.k, table, j, kvh, kbuf);
    for (int g = 0; g < G; ++g) scores[(int64_t)g * n + j] = dot(q + g * D, k, D) * a.scale;
  }
  float* sums = acc + (int64_t)G * D;
  for (int g = 0; g < G; ++g) {
    sums[g] = 0.f;
    float* s = scores + (int64_t)g * n;
    float m = s[0];
    for (int j = 1; j < n; ++j) m = s[j] > m ? s[j] : m;
    for (int j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      sums[g] += s[j];
    }
  }
  std::memset(acc, 0, sizeof(float) * G * D);
  for (int j = 0; j < n; ++j) {
    const float* v = kv_row(a, a.v, table, j, kvh, kbuf);
    for (int g = 0; g < G; ++g) {
      const float p = scores[(int64_t)g * n + j];
      float* __restrict o = acc + g * D;
      for (int d = 0; d < D; ++d) o[d] += p * v[d];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) acc[g * D + d] /= sums[g];
}

inline uint16_t bf16_bits(float f) { return f32_to_bf16(f); }

// The step's new K and V rows into their cache slots (bf16 or fp32, copied as they are).
void write_new_kv(const AttentionArgs& a, int64_t num_tokens, int64_t num_blocks) {
  const int64_t row = (int64_t)a.num_kv_heads * a.head_dim, slots = num_blocks * a.block_size;
  const size_t el = a.kv_bf16 ? 2 : 4;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (a.slots[t] < 0 || a.slots[t] >= slots) throw std::invalid_argument("slot out of range");
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t at = a.slots[t] * row;
    std::memcpy((char*)a.k + at * el, (const char*)a.k_new + t * a.k_row_stride * el, row * el);
    std::memcpy((char*)a.v + at * el, (const char*)a.v_new + t * a.v_row_stride * el, row * el);
  }
}

}  // namespace

void paged_attention_cpu(const AttentionArgs& a, int64_t num_tokens, int64_t num_blocks) {
  if (a.block_size <= 0 || a.num_heads <= 0 || a.num_kv_heads <= 0 || a.head_dim <= 0)
    throw std::invalid_argument("block_size, heads and head_dim must be positive");
  if (a.num_heads % a.num_kv_heads) throw std::invalid_argument("heads % kv_heads != 0");
  const int G = a.num_heads / a.num_kv_heads;
  int64_t longest = 0;
  for (int i = 0; i < a.num_seqs; ++i) {
    const int64_t s0 = a.q_starts[i], ql = a.q_lens[i], sl = a.seq_lens[i];
    if (ql < 0 || s0 < 0 || s0 + ql > num_tokens || sl < ql ||
        sl > (int64_t)a.max_blocks * a.block_size)
      throw std::invalid_argument("sequence rows or KV length out of range");
    const int64_t used = (sl + a.block_size - 1) / a.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t blk = a.block_tables[(int64_t)i * a.max_blocks + b];
      if (blk < 0 || blk >= num_blocks) throw std::invalid_argument("block id out of range");
    }
    longest = sl > longest ? sl : longest;
  }
  if (a.k_new) write_new_kv(a, num_tokens, num_blocks);
  const int D = a.head_dim;
  const int64_t q_stride = a.q_row_stride ? a.q_row_stride : (int64_t)a.num_heads * D;
  std::vector<float> scores((size_t)G * longest), acc((size_t)G * (D + 1)), kbuf(D),
      qbuf((size_t)G * D);
  for (int i = 0; i < a.num_seqs; ++i) {
    const int32_t* table = a.block_tables + (int64_t)i * a.max_blocks;
    const int64_t s0 = a.q_starts[i], ql = a.q_lens[i], sl = a.seq_lens[i];
    for (int64_t r = 0; r < ql; ++r)
      for (int h = 0; h < a.num_kv_heads; ++h) {
        const int64_t first = (s0 + r) * q_stride + (int64_t)h * G * D;  // this group's q
        const float* q = (const float*)a.q + first;
        if (a.q_bf16) {
          const uint16_t* qb = (const uint16_t*)a.q + first;
          for (int d = 0; d < G * D; ++d) qbuf[d] = bf16_value(qb[d]);
          q = qbuf.data();
        }
        attend(a, q, (int)(sl - ql + r), h, table, scores.data(), acc.data(), kbuf.data());
        const int64_t o = ((s0 + r) * a.num_heads + (int64_t)h * G) * D;
        if (a.out_bf16)
          for (int d = 0; d < G * D; ++d) ((uint16_t*)a.out)[o + d] = bf16_bits(acc[d]);
        else
          std::memcpy((float*)a.out + o, acc.data(), sizeof(float) * G * D);
      }
  }
}

}  // namespace tandem_cpu
