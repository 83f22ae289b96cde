// The experts' activation between the gate/up and down projections, chosen per layer: SiLU(gate)
// * up (every family but GPT-OSS), or per-expert biases with GPT-OSS's clamped SwiGLU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace tandem_cpu {

enum ActKind : int { ACT_SILU = 0, ACT_CLAMPED_SWIGLU = 1 };

// A layer's activation and biases, fp32: b13 [E][2I] (gate then up) and b2 [E][H], or empty.
// Clamped SwiGLU (transformers' GptOssExperts): gate clamped above at `limit`, up to +-`limit`,
// then (up + 1) * gate * sigmoid(alpha * gate).
struct ExpertAct {
  int kind = ACT_SILU;
  float alpha = 1.f, limit = 0.f;
  std::vector<float> b13, b2;
  bool plain() const { return kind == ACT_SILU && b13.empty(); }
};

// dst[j] = the activation of column i0 + j (j < n) of expert e, from its gate g[j] and up u[j]
// projections; 0 for padding columns (i0 + j >= I), whose down weights are zero.
inline void activate(const ExpertAct& a, int e, int I, int i0, const float* g, const float* u,
                     float* dst, int n) {
  const float* bias = a.b13.empty() ? nullptr : a.b13.data() + (size_t)e * 2 * I;
  for (int j = 0; j < n; ++j) {
    const int i = i0 + j;
    if (i >= I) {
      dst[j] = 0.f;
      continue;
    }
    float gv = g[j], uv = u[j];
    if (bias) {
      gv += bias[i];
      uv += bias[I + i];
    }
    if (a.kind == ACT_CLAMPED_SWIGLU) {
      gv = std::min(gv, a.limit);
      uv = std::min(std::max(uv, -a.limit), a.limit);
      dst[j] = (uv + 1.f) * (gv / (1.f + std::exp(-a.alpha * gv)));
    } else {
      dst[j] = gv / (1.f + std::exp(-gv)) * uv;
    }
  }
}

}  // namespace tandem_cpu
