// Vector helpers shared by the compiled CPU kernels (selective_scan_cpu.cpp, gated_silu_cpu.cpp): GCC/Clang vector
// extensions, which compile to AVX-512 under -march=native where the CPU has it (two or four ops on narrower ISAs).
#pragma once

#include <cstdint>
#include <cstring>

namespace cpu_vec {

constexpr int W = 16;  // lanes: one 64-byte vector of fp32
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));  // 16 bf16 bit patterns
constexpr float LOG2E = 1.4426950408889634f;

inline vf splat(float x) { return vf{} + x; }

// Loads and stores of w <= W lanes (w < W only at the end of a row): a full vector is one unaligned load or store.
inline vf load(const float* p, int w) {
  vf v = {};
  if (w == W) std::memcpy(&v, p, sizeof v);
  else for (int j = 0; j < w; ++j) v[j] = p[j];
  return v;
}

inline void store(float* p, vf v, int w) {
  if (w == W) std::memcpy(p, &v, sizeof v);
  else for (int j = 0; j < w; ++j) p[j] = v[j];
}

// bf16 is the upper half of an fp32: widening is a shift; narrowing rounds to nearest even, NaN stays NaN.
inline vf load(const uint16_t* p, int w) {
  vh h = {};
  if (w == W) std::memcpy(&h, p, sizeof h);
  else for (int j = 0; j < w; ++j) h[j] = p[j];
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

inline void store(uint16_t* p, vf v, int w) {
  const vu bits = (vu)v;
  const vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vh h = __builtin_convertvector(v != v ? vu{} + 0x7FC0u : rounded, vh);
  if (w == W) std::memcpy(p, &h, sizeof h);
  else for (int j = 0; j < w; ++j) p[j] = h[j];
}

// 2^x (libm's exp2f is scalar): x = n + f with n = round(x), |f| <= 1/2; 2^f by its degree-7 Taylor polynomial
// (relative error below 6e-9, under fp32's half ulp), 2^n written into the exponent bits. x is clamped to
// [-126, 126]: below, the result is the smallest normal float instead of a subnormal or zero.
inline vf exp2v(vf x) {
  x = x < -126.0f ? splat(-126.0f) : x;
  x = x > 126.0f ? splat(126.0f) : x;
  const vf r = x + 0x1.8p23f;  // adding 1.5·2^23 rounds x to an integer held in the low mantissa bits
  const vf f = x - (r - 0x1.8p23f);
  vf p = splat(1.5252733804059841e-05f);  // (ln 2)^k / k!, k = 7 … 0
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910072e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  const vi e = ((vi)r - 0x4B400000 + 127) << 23;  // the bit pattern of 2^n
  return p * (vf)e;
}

inline vf sigmoid(vf z) { return 1.0f / (1.0f + exp2v(z * -LOG2E)); }

}  // namespace cpu_vec
