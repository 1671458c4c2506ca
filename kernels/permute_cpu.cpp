// MoE token permutation on CPU: the weighted combine of expert rows back into tokens, and the backward passes
// of the gather and of the combine, each one pass over the rows with fp32 accumulation.
//
// Built and loaded by permute_cpu.py (plain C ABI, no torch headers). Assignment a = k·T + t (slot-major);
// row_of (K·T) int64: the routed row of each assignment, or -1 where it was dropped. Rows and tokens are (·, D)
// contiguous, T is float (fp32) or uint16_t (bf16 bit patterns); weights and their gradient are fp32. A task is
// one token: it reads its K rows and writes its own outputs, so no two threads write the same memory. In torch
// the same work is a gather, a dtype conversion and a multiply-add per slot, each a pass over (T, D).
#include <cstdint>

#include <omp.h>

#include "cpu_vec.h"

namespace {

using namespace cpu_vec;

inline float hsum(vf v) {
  float s = 0.0f;
  for (int j = 0; j < W; ++j) s += v[j];
  return s;
}

// out[t] = Σ_k scale[a] · rows[row_of[a]] over kept a = k·T + t (scale 1 where null).
template <typename T>
void combine(int64_t tokens, int64_t K, int64_t D, const T* rows, const int64_t* row_of, const float* scale, T* out,
             int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < D; j += W) {
      const int w = D - j < W ? static_cast<int>(D - j) : W;
      vf acc = {};
      for (int64_t k = 0; k < K; ++k) {
        const int64_t a = k * tokens + t, r = row_of[a];
        if (r >= 0) acc += (scale ? scale[a] : 1.0f) * load(rows + r * D + j, w);
      }
      store(out + t * D + j, acc, w);
    }
  }
}

// The combine's backward: grad_rows[row_of[a]] = weight[a] · grad_out[t], grad_weight[a] = <grad_out[t], rows[row]>
// (0 for a dropped assignment).
template <typename T>
void combine_backward(int64_t tokens, int64_t K, int64_t D, const T* rows, const T* grad_out, const int64_t* row_of,
                      const float* weight, T* grad_rows, float* grad_weight, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t a = k * tokens + t, r = row_of[a];
      if (r < 0) {
        grad_weight[a] = 0.0f;
        continue;
      }
      vf dot = {};
      for (int64_t j = 0; j < D; j += W) {
        const int w = D - j < W ? static_cast<int>(D - j) : W;
        const vf g = load(grad_out + t * D + j, w);
        dot += g * load(rows + r * D + j, w);
        store(grad_rows + r * D + j, g * weight[a], w);
      }
      grad_weight[a] = hsum(dot);
    }
  }
}

}  // namespace

extern "C" {

// bf16: 0 for fp32 tensors, 1 for bf16; scale may be null.
void permute_combine(int64_t tokens, int64_t K, int64_t D, int bf16, const void* rows, const int64_t* row_of,
                     const float* scale, void* out, int threads) {
  if (bf16) {
    combine(tokens, K, D, static_cast<const uint16_t*>(rows), row_of, scale, static_cast<uint16_t*>(out), threads);
  } else {
    combine(tokens, K, D, static_cast<const float*>(rows), row_of, scale, static_cast<float*>(out), threads);
  }
}

void permute_combine_bwd(int64_t tokens, int64_t K, int64_t D, int bf16, const void* rows, const void* grad_out,
                         const int64_t* row_of, const float* weight, void* grad_rows, float* grad_weight,
                         int threads) {
  if (bf16) {
    combine_backward(tokens, K, D, static_cast<const uint16_t*>(rows), static_cast<const uint16_t*>(grad_out), row_of,
                     weight, static_cast<uint16_t*>(grad_rows), grad_weight, threads);
  } else {
    combine_backward(tokens, K, D, static_cast<const float*>(rows), static_cast<const float*>(grad_out), row_of,
                     weight, static_cast<float*>(grad_rows), grad_weight, threads);
  }
}

}  // extern "C"
