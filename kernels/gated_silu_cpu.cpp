// Gated SiLU over a fused [gate | up] projection on CPU: h = silu(a) · b and its backward, one pass each.
//
// Built and loaded by gated_silu_cpu.py (plain C ABI, no torch headers). ab: (rows, 2·half) contiguous, [a | b] per
// row; h, dh: (rows, half); dab: (rows, 2·half). T is float (fp32) or uint16_t (bf16 bit patterns); the math runs in
// fp32. In torch each of silu, its backward and the products is a separate pass over (rows, half) tensors, and on
// CPU every bf16 op widens and narrows its operands again: the expert activation cost about a sixth of a bf16 MoE
// layer's time.
#include <cstdint>

#include <omp.h>

#include "cpu_vec.h"

namespace {

using namespace cpu_vec;

template <typename T>
void forward(int64_t rows, int64_t half, const T* ab, T* h, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* a = ab + r * 2 * half;
    const T* b = a + half;
    T* out = h + r * half;
    for (int64_t j = 0; j < half; j += W) {
      const int w = half - j < W ? static_cast<int>(half - j) : W;
      const vf av = load(a + j, w);
      store(out + j, av * sigmoid(av) * load(b + j, w), w);
    }
  }
}

// da = dh · b · silu'(a) with silu'(a) = σ(a) (1 + a (1 − σ(a))); db = dh · silu(a).
template <typename T>
void backward(int64_t rows, int64_t half, const T* ab, const T* dh, T* dab, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* a = ab + r * 2 * half;
    const T* b = a + half;
    const T* g = dh + r * half;
    T* da = dab + r * 2 * half;
    T* db = da + half;
    for (int64_t j = 0; j < half; j += W) {
      const int w = half - j < W ? static_cast<int>(half - j) : W;
      const vf av = load(a + j, w), gv = load(g + j, w), s = sigmoid(av);
      store(da + j, gv * load(b + j, w) * s * (1.0f + av * (1.0f - s)), w);
      store(db + j, gv * av * s, w);
    }
  }
}

}  // namespace

extern "C" {

// bf16: 0 for fp32 tensors, 1 for bf16.
void gated_silu_fwd(int64_t rows, int64_t half, int bf16, const void* ab, void* h, int threads) {
  if (bf16) forward(rows, half, static_cast<const uint16_t*>(ab), static_cast<uint16_t*>(h), threads);
  else forward(rows, half, static_cast<const float*>(ab), static_cast<float*>(h), threads);
}

void gated_silu_bwd(int64_t rows, int64_t half, int bf16, const void* ab, const void* dh, void* dab, int threads) {
  if (bf16) {
    backward(rows, half, static_cast<const uint16_t*>(ab), static_cast<const uint16_t*>(dh),
             static_cast<uint16_t*>(dab), threads);
  } else {
    backward(rows, half, static_cast<const float*>(ab), static_cast<const float*>(dh), static_cast<float*>(dab),
             threads);
  }
}

}  // extern "C"
