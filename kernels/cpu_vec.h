// Vector helpers shared by the compiled CPU kernels (selective_scan_cpu.cpp, gated_silu_cpu.cpp, permute_cpu.cpp):
// GCC/Clang vector extensions, which compile to AVX-512 under -march=native where the CPU has it (two or four ops on
// narrower ISAs), and AVX-512 intrinsics for the loads and stores where it is there.
#pragma once

#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace cpu_vec {

constexpr int W = 16;  // lanes: one 64-byte vector of fp32
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));  // 16 bf16 bit patterns
constexpr float LOG2E = 1.4426950408889634f;

inline vf splat(float x) { return vf{} + x; }

// Loads and stores of w <= W lanes (w < W only at the end of a row). With AVX-512 (BW, BF16) they are masked vector
// loads and stores, and the bf16 narrowing is one VCVTNEPS2BF16 (round to nearest even, as below). GCC compiles the
// portable forms below into copies through the stack and a seven-op rounding. Measured in one process against
// them: the bf16 gated SiLU 0.70-0.80x the time, the bf16 combine 0.52x and its backward 0.62-0.73x, the whole
// bf16 MoE layer 0.84-0.97x (E=8) and 0.89-0.95x (E=64), all with the same bits (tests/kernels/test_cpu_vec.py);
// the selective scan fwd+bwd 0.78-0.83x, its D gradient within an fp32 rounding (a multiply-add now contracts).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
inline __mmask16 lanes(int w) { return static_cast<__mmask16>((1u << w) - 1u); }

inline vf load(const float* p, int w) { return (vf)_mm512_maskz_loadu_ps(lanes(w), p); }

inline void store(float* p, vf v, int w) { _mm512_mask_storeu_ps(p, lanes(w), (__m512)v); }

inline vf load(const uint16_t* p, int w) {
  const __m256i h = _mm256_maskz_loadu_epi16(lanes(w), p);
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}

inline void store(uint16_t* p, vf v, int w) {
  _mm256_mask_storeu_epi16(p, lanes(w), (__m256i)_mm512_cvtneps_pbh((__m512)v));
}
#else
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
#endif

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
