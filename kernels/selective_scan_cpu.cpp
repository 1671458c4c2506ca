// Mamba-1 selective scan on CPU: the sequential recurrence, fused, vectorized over 16 channels at a time.
//
// Built and loaded by selective_scan_cpu.py (plain C ABI, no torch headers). Layout: time-major, contiguous fp32
//   u, delta, z: (batch, len, dim)   At: (state, dim), A transposed   B, C: (batch, len, state)   Dskip: (dim)
// Dskip and z may be null.
// A task is one batch row × one block of W (16) channels; its state h (state × W) stays in registers/L1 while it walks
// the sequence, so every input is read once and nothing of size (batch, len, state, dim) touches memory, unlike
// any composition of torch ops (the chunked PyTorch scan in moe_dist/layers/scan.py makes ~20 such passes).
// Forward:  a_t = exp(Δ_t A),  h_t = a_t h_{t-1} + Δ_t u_t B_t,  y_t = (<h_t, C_t> + D u_t) · silu(z_t).
// Backward: the forward recurrence again, keeping every h_t of the task (len × state × W floats, per thread),
// then the adjoint backwards over t (formulas in moe_dist/layers/scan.py, _SelectiveScan).
#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "cpu_vec.h"

namespace {

using namespace cpu_vec;

struct Scan {
  int64_t batch, len, dim, state;
  const float *u, *delta, *At, *B, *C, *Dskip, *z;
};

// The recurrence for batch row b, channels d0 … d0+w-1. With H (len × state vectors), every h_t is kept there;
// without, only the running state, in hloc (state vectors). With y, writes y_t.
void recur(const Scan& s, int64_t b, int64_t d0, int w, vf* H, vf* hloc, float* y) {
  std::fill(hloc, hloc + s.state, vf{});
  const vf* hprev = hloc;
  const vf dskip = s.Dskip ? load(s.Dskip + d0, w) : vf{};
  for (int64_t t = 0; t < s.len; ++t) {
    const int64_t row = b * s.len + t;
    const vf dt = load(s.delta + row * s.dim + d0, w), ut = load(s.u + row * s.dim + d0, w);
    const vf du = dt * ut, dt2 = dt * LOG2E;
    const float* Bt = s.B + row * s.state;
    const float* Ct = s.C + row * s.state;
    vf* h = H ? H + t * s.state : hloc;
    vf acc = dskip * ut;
    for (int64_t n = 0; n < s.state; ++n) {
      const vf a = exp2v(dt2 * load(s.At + n * s.dim + d0, w));
      const vf hn = a * hprev[n] + du * Bt[n];
      h[n] = hn;
      acc += hn * Ct[n];
    }
    hprev = h;
    if (y && s.z) {
      const vf zt = load(s.z + row * s.dim + d0, w);
      acc *= zt * sigmoid(zt);
    }
    if (y) store(y + row * s.dim + d0, acc, w);
  }
}

// The adjoint for the same task, given all its states H: λ_t = g_t C_t + a_{t+1} λ_{t+1} backwards over t, carried
// in lam as a_t λ_t, where g_t = dy_t silu(z_t) is the gradient reaching the ungated output y'_t = <h_t, C_t> + D u_t
// (dz_t = dy_t y'_t silu'(z_t) recomputes y'_t from h_t). Writes d_u, d_delta, dz and this task's slices of dA_part
// (batch, state, dim) and dD_part (batch, dim); adds λΔu and h·g
// into the thread's lane-wise dB/dC accumulators (batch, len, state, W), summed over threads and lanes by the caller
// (lane sums here would cost a horizontal reduction per (t, n)).
void adjoint(const Scan& s, int64_t b, int64_t d0, int w, const vf* H, const float* dy, vf* lam, vf* dA,
             float* d_u, float* d_delta, float* dz, float* dA_part, float* dD_part, vf* dB_acc, vf* dC_acc) {
  std::fill(lam, lam + s.state, vf{});
  std::fill(dA, dA + s.state, vf{});
  const vf dskip = s.Dskip ? load(s.Dskip + d0, w) : vf{};
  vf dD = {};
  for (int64_t t = s.len - 1; t >= 0; --t) {
    const int64_t row = b * s.len + t;
    const vf dt = load(s.delta + row * s.dim + d0, w), ut = load(s.u + row * s.dim + d0, w);
    const vf dyt = load(dy + row * s.dim + d0, w);
    const vf zt = s.z ? load(s.z + row * s.dim + d0, w) : vf{};
    const vf sig = s.z ? sigmoid(zt) : vf{};
    const vf gy = s.z ? dyt * zt * sig : dyt;
    const vf du = dt * ut, dt2 = dt * LOG2E;
    const float* Bt = s.B + row * s.state;
    const float* Ct = s.C + row * s.state;
    const vf* ht = H + t * s.state;
    const vf* hprev = t ? H + (t - 1) * s.state : nullptr;  // h_{-1} = 0
    vf* dBt = dB_acc + row * s.state;
    vf* dCt = dC_acc + row * s.state;
    vf lamB = {}, wA = {}, yt = dskip * ut;
    for (int64_t n = 0; n < s.state; ++n) {
      const vf An = load(s.At + n * s.dim + d0, w);
      const vf a = exp2v(dt2 * An);
      const vf l = gy * Ct[n] + lam[n];
      const vf wn = hprev ? l * a * hprev[n] : vf{};  // the gradient reaching Δ_t A
      dA[n] += wn * dt;
      wA += wn * An;
      lamB += l * Bt[n];
      dBt[n] += l * du;
      dCt[n] += ht[n] * gy;
      yt += ht[n] * Ct[n];
      lam[n] = a * l;
    }
    if (s.z) store(dz + row * s.dim + d0, dyt * yt * sig * (1.0f + zt * (1.0f - sig)), w);
    dD += ut * gy;
    store(d_u + row * s.dim + d0, dt * lamB + dskip * gy, w);
    store(d_delta + row * s.dim + d0, ut * lamB + wA, w);
  }
  for (int64_t n = 0; n < s.state; ++n) store(dA_part + (b * s.state + n) * s.dim + d0, dA[n], w);
  store(dD_part + b * s.dim + d0, dD, w);
}

}  // namespace

extern "C" {

// y (batch, len, dim).
void scan_fwd(int64_t batch, int64_t len, int64_t dim, int64_t state, const float* u, const float* delta,
              const float* At, const float* B, const float* C, const float* Dskip, const float* z, float* y,
              int threads) {
  const Scan s{batch, len, dim, state, u, delta, At, B, C, Dskip, z};
  const int64_t blocks = (dim + W - 1) / W;
#pragma omp parallel num_threads(threads)
  {
    std::vector<vf> hloc(state);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < batch * blocks; ++task) {
      const int64_t b = task / blocks, d0 = task % blocks * W;
      recur(s, b, d0, static_cast<int>(std::min<int64_t>(W, dim - d0)), nullptr, hloc.data(), y);
    }
  }
}

// d_u, d_delta, dz (batch, len, dim; dz unused without z); dA_part (batch, state, dim); dD_part (batch, dim);
// dB_part, dC_part (threads, batch, len, state, W), zeroed by the caller.
void scan_bwd(int64_t batch, int64_t len, int64_t dim, int64_t state, const float* u, const float* delta,
              const float* At, const float* B, const float* C, const float* Dskip, const float* z, const float* dy,
              float* d_u, float* d_delta, float* dz, float* dA_part, float* dD_part, float* dB_part, float* dC_part,
              int threads) {
  const Scan s{batch, len, dim, state, u, delta, At, B, C, Dskip, z};
  const int64_t blocks = (dim + W - 1) / W;
#pragma omp parallel num_threads(threads)
  {
    std::vector<vf> H(len * state), hloc(state), lam(state), dA(state);
    const int64_t slot = omp_get_thread_num() * batch * len * state;
    vf* dB_acc = reinterpret_cast<vf*>(dB_part) + slot;
    vf* dC_acc = reinterpret_cast<vf*>(dC_part) + slot;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < batch * blocks; ++task) {
      const int64_t b = task / blocks, d0 = task % blocks * W;
      const int w = static_cast<int>(std::min<int64_t>(W, dim - d0));
      recur(s, b, d0, w, H.data(), hloc.data(), nullptr);
      adjoint(s, b, d0, w, H.data(), dy, lam.data(), dA.data(), d_u, d_delta, dz, dA_part, dD_part, dB_acc, dC_acc);
    }
  }
}

}  // extern "C"
