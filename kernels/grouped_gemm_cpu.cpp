// Grouped bf16 GEMM on Intel AMX: C_g = A_g · B_g for every group g in one call, fp32 accumulation in the tiles,
// one bf16 rounding per output, optionally with the experts' gated SiLU in its epilogue; plus the packings that
// feed it (the expert GEMMs of an MoE layer, forward and both gradients; grouped_gemm_cpu.py drives them).
//
// Why by hand: torch's CPU grouped_mm makes one oneDNN matmul call per expert, each repacking its weight and
// re-deriving its blocking; at 8 experts those GEMMs reached 0.66 of a large matmul's rate, at 64 experts 0.52.
// Here the groups of a call are slices of one work list, and each weight is packed once per pass.
//
// Layouts. A_g: row-major (M_g, K_g), row stride lda_g. B_g: "VNNI" packed, [N/16][K_g/2][16][2]: for each
// 16-column panel, the K rows taken in pairs with the pair's two values side by side (what TDPBF16PS reads).
// C_g: row-major (M_g, N), row stride ldc, 64-byte aligned (torch's CPU allocations are). K_g and N are multiples
// of 32 (the packings pad K with zeros); M_g is any.
// The tiles: 0..3 accumulate a 32×32 block of C, 4..5 hold two 16-row slices of A, 6..7 two 16-column panels of B.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int64_t BLOCK = 32;       // rows and columns of C per micro-kernel call
constexpr int64_t UNIT_BYTES = 512 << 10;  // A rows per work unit: up to 512 KiB, which stay in L2 while B panels
                                           // stream by (each panel is read once per unit: fewer, larger units
                                           // read less of B from memory)

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;  // 16 rows × 64 bytes: the full tile
  _tile_loadconfig(&cfg);
}

// The store of one finished 32×32 accumulator block (tiles in the order of block_32x32): its rows [first, rows) as
// bf16 into c (64-byte aligned rows, stride ldc), written row by row inside the next block's multiply loop, so that
// the conversions and stores run while the tile unit multiplies instead of between blocks (measured in one process
// against storing each block after its loop: the expert GEMMs of the E=8 and E=64 MoE layers, forward and
// backward, 0.86-0.96× and 0.87-0.95× the time in 6 runs each; the whole bf16 layer 0.83-0.97× in 3 each).
// One AVX512-BF16 conversion (round to nearest even) per 32 outputs, and non-temporal stores: C is written once
// and is larger than L2, and ordinary stores would first read every line of it from memory (measured in one
// process against ordinary stores: 1.3-1.6× the rate of a large forward GEMM, 0.92-0.95× the time of the whole
// MoE layer).
struct Pending {
  const float* acc = nullptr;
  int64_t rows = 0;  // rows [first, rows) to store; none if rows <= first
  uint16_t* c = nullptr;
  int64_t ldc = 0;
  // The gated mode (the experts' [gate | up] projection): `acc` is a gate block, `up` the up block of the same rows
  // and columns, stored to c_up; h = silu(gate) · up (of the bf16-rounded values, with gated_silu_cpu's formula:
  // the same bits) goes to h (stride ldh). Null `up`: a plain block. The SiLU's vector work runs while the tile
  // unit multiplies: with it, a forward gate/up GEMM took about 1 ms more at E=8 and E=64 (D=512), its own pass
  // 3-6 ms; the gated forward 0.73-0.93x the time of the GEMM and the pass (same process).
  const float* up = nullptr;
  uint16_t* c_up = nullptr;
  uint16_t* h = nullptr;
  int64_t ldh = 0;
  int64_t first = 0;

  static __m512bh rounded(const float* tile) {
    return _mm512_cvtne2ps_pbh(_mm512_load_ps(tile + 256), _mm512_load_ps(tile));
  }
  static void stream(uint16_t* dst, __m512bh v) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), reinterpret_cast<__m512i>(v));
  }
  static cpu_vec::vf widened(__m512bh v, int half) {  // 16 of the 32 bf16 back to fp32
    const __m256i h = half ? _mm512_extracti64x4_epi64(reinterpret_cast<__m512i>(v), 1)
                           : _mm512_castsi512_si256(reinterpret_cast<__m512i>(v));
    return (cpu_vec::vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  }

  void row(int64_t r) const {
    const int64_t at = (r / 16) * 512 + (r % 16) * 16;
    const __m512bh gate = rounded(acc + at);
    stream(c + r * ldc, gate);
    if (!up) return;
    const __m512bh upv = rounded(up + at);
    stream(c_up + r * ldc, upv);
    cpu_vec::vf out[2];
    for (int half = 0; half < 2; ++half) {
      const cpu_vec::vf a = widened(gate, half);
      out[half] = a * cpu_vec::sigmoid(a) * widened(upv, half);
    }
    stream(h + r * ldh, _mm512_cvtne2ps_pbh((__m512)out[1], (__m512)out[0]));
  }
};

// One 32×32 block of C = A (32 rows, stride lda) · two 16-column panels of packed B, over K, into `acc` (4 tiles of
// 16×16 fp32); the rows of the `pending` block are stored along the way.
inline void block_32x32(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t K,
                        float* acc, const Pending& pending) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t steps = std::max<int64_t>(K / 32, 1), n = std::max<int64_t>(pending.rows - pending.first, 0);
  int64_t done = 0;
  for (int64_t k = 0, step = 1; k < K; k += 32, ++step) {
    _tile_loadd(4, a + k, lda * 2);
    _tile_loadd(5, a + 16 * lda + k, lda * 2);
    _tile_loadd(6, b0 + k * 16, 64);
    _tile_loadd(7, b1 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    for (const int64_t upto = n * step / steps; done < upto; ++done) pending.row(pending.first + done);
  }
  for (; done < n; ++done) pending.row(pending.first + done);  // K = 0: an expert without rows (weight gradient)
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 256, 64);
  _tile_stored(2, acc + 512, 64);
  _tile_stored(3, acc + 768, 64);
}

// dst row j (16 uint32 at dst + j·ld_dst) = column j of the 16 × 16 block at src (rows at src + i·ld_src).
inline void transpose_16x16(const uint32_t* src, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
  alignas(64) uint32_t block[16 * 16];
  for (int i = 0; i < 16; ++i)
    _mm512_store_si512(block + 16 * i, _mm512_loadu_si512(src + i * ld_src));
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int j = 0; j < 16; ++j)
    _mm512_storeu_si512(dst + j * ld_dst, _mm512_i32gather_epi32(_mm512_add_epi32(column, _mm512_set1_epi32(j)),
                                                                 block, 4));
}

// Word indices for _mm512_permutex2var_epi16 over (row r0's 32 bf16, row r1's 32): columns [first, first + 16) of
// the two rows interleaved, (r0[first], r1[first], r0[first + 1], ...).
inline __m512i pair_index(int first) {
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<uint16_t>(first + i);
    idx[2 * i + 1] = static_cast<uint16_t>(32 + first + i);
  }
  return _mm512_load_si512(idx);
}

// 32 bf16 of row r0 and of row r1 (a null row reads zeros) interleaved: columns 0..15 into lo, 16..31 into hi. A
// whole 64-byte line of each row per call: a 16-column version read each line twice, in separate passes.
inline void interleave_rows(const uint16_t* r0, const uint16_t* r1, __m512i index_lo, __m512i index_hi, __m512i& lo,
                            __m512i& hi) {
  const __m512i a = r0 ? _mm512_loadu_si512(r0) : _mm512_setzero_si512();
  const __m512i b = r1 ? _mm512_loadu_si512(r1) : _mm512_setzero_si512();
  lo = _mm512_permutex2var_epi16(a, index_lo, b);
  hi = _mm512_permutex2var_epi16(a, index_hi, b);
}

struct Unit {
  int64_t group, row0, rows;
};

}  // namespace

extern "C" {

// Asks Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) for this process; 0 on success.
int amx_request() { return static_cast<int>(syscall(SYS_arch_prctl, 0x1023, 18)); }

// h non-null: the gated mode. N = 2F with C = [gate | up]; h + h_off_g gets (M_g, F) = silu(gate) · up (row
// stride ldh). F % 32 == 0.
void grouped_gemm(int64_t G, const int64_t* M, const int64_t* K, int64_t N, const uint16_t* a, const int64_t* a_off,
                  const int64_t* lda, const uint16_t* b, const int64_t* b_off, uint16_t* c, const int64_t* c_off,
                  int64_t ldc, uint16_t* h, const int64_t* h_off, int64_t ldh, int threads) {
  std::vector<Unit> units;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t unit_rows = std::max<int64_t>(BLOCK, UNIT_BYTES / std::max<int64_t>(2 * K[g], 1) / BLOCK * BLOCK);
    for (int64_t r = 0; r < M[g]; r += unit_rows) units.push_back({g, r, std::min(unit_rows, M[g] - r)});
  }
  const int64_t panels = N / BLOCK, n_units = static_cast<int64_t>(units.size());
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    alignas(64) float acc[2][2][4 * 256];  // the block (gated: gate and up blocks) being multiplied, the one stored
    int cur = 0;
    Pending pending;
    std::vector<uint16_t> tail;  // a last block of fewer than 32 rows, zero-padded to 32
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < n_units; ++u) {
      const Unit& unit = units[u];
      const int64_t g = unit.group, Kg = K[g], ld = lda[g];
      const uint16_t* ag = a + a_off[g] + unit.row0 * ld;
      const uint16_t* bg = b + b_off[g];
      uint16_t* cg = c + c_off[g] + unit.row0 * ldc;
      const int64_t full = unit.rows / BLOCK * BLOCK, rest = unit.rows - full;
      if (rest) {
        tail.assign(BLOCK * Kg, 0);
        for (int64_t r = 0; r < rest; ++r) std::memcpy(&tail[r * Kg], ag + (full + r) * ld, Kg * 2);
      }
      const auto panel = [&](int64_t p) { return bg + 2 * p * (Kg / 2) * 32; };  // its halves: + 0, + (Kg/2)·32
      if (!h) {
        for (int64_t p = 0; p < panels; ++p) {  // B panel p (32 columns) stays in cache across the unit's row blocks
          for (int64_t r = 0; r < unit.rows; r += BLOCK) {
            const bool whole = unit.rows - r >= BLOCK;
            block_32x32(whole ? ag + r * ld : tail.data(), whole ? ld : Kg, panel(p), panel(p) + (Kg / 2) * 32, Kg,
                        acc[cur][0], pending);
            pending = {acc[cur][0], std::min(BLOCK, unit.rows - r), cg + r * ldc + p * BLOCK, ldc};
            cur ^= 1;
          }
        }
      } else {  // gate panel q and up panel q + F/32 back to back on each row block; the pair is stored together
        uint16_t* hg = h + h_off[g] + unit.row0 * ldh;
        const int64_t half = panels / 2;
        for (int64_t q = 0; q < half; ++q) {
          for (int64_t r = 0; r < unit.rows; r += BLOCK) {
            const bool whole = unit.rows - r >= BLOCK;
            const uint16_t* ar = whole ? ag + r * ld : tail.data();
            Pending top = pending, bottom = pending;  // the pending pair's rows, split over the two blocks
            top.rows = std::min<int64_t>(pending.rows, 16);
            bottom.first = 16;
            block_32x32(ar, whole ? ld : Kg, panel(q), panel(q) + (Kg / 2) * 32, Kg, acc[cur][0], top);
            block_32x32(ar, whole ? ld : Kg, panel(q + half), panel(q + half) + (Kg / 2) * 32, Kg, acc[cur][1],
                        bottom);
            const int64_t rows = std::min(BLOCK, unit.rows - r);
            pending = {acc[cur][0], rows,        cg + r * ldc + q * BLOCK,         ldc, acc[cur][1],
                       cg + r * ldc + (q + half) * BLOCK, hg + r * ldh + q * BLOCK, ldh};
            cur ^= 1;
          }
        }
      }
    }
    for (int64_t r = pending.first; r < pending.rows; ++r) pending.row(r);  // this thread's last block
    _tile_release();
    _mm_sfence();  // the streamed stores are visible before the caller reads C
  }
}

// B rows → VNNI for G groups: group g is src rows [row0_g, row0_g + K_g) of a row-major (·, N) matrix (row stride
// ld), packed into dst + dst_off_g with its K padded with zero rows to Kpad_g (a multiple of 32). N % 32 == 0.
// One task per (group, two 16-column panels): its outputs are two contiguous runs.
void pack_rows(int64_t G, const int64_t* row0, const int64_t* Kg, const int64_t* Kpad, int64_t N, const uint16_t* src,
               int64_t ld, uint16_t* dst, const int64_t* dst_off, int threads) {
  const int64_t pairs_of_panels = N / 32;
  const __m512i index_lo = pair_index(0), index_hi = pair_index(16);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int64_t g = 0; g < G; ++g)
    for (int64_t q = 0; q < pairs_of_panels; ++q) {
      uint16_t* out_lo = dst + dst_off[g] + 2 * q * Kpad[g] * 16;
      uint16_t* out_hi = out_lo + Kpad[g] * 16;
      const uint16_t* rows = src + row0[g] * ld + q * 32;
      for (int64_t k = 0; k < Kpad[g]; k += 2) {
        __m512i lo, hi;
        interleave_rows(k < Kg[g] ? rows + k * ld : nullptr, k + 1 < Kg[g] ? rows + (k + 1) * ld : nullptr, index_lo,
                        index_hi, lo, hi);
        _mm512_storeu_si512(out_lo + k * 16, lo);
        _mm512_storeu_si512(out_hi + k * 16, hi);
      }
    }
}

// B = Wᵀ → VNNI for each of G stacked row-major (N, K) matrices W_g (src + g·N·K): B(k, n) = W_g[n][k], so each
// pair (k, k+1) is already adjacent in W's row n, and the packing is a transpose of 32-bit pairs.
// dst + g·N·K gets [N/16][K/2][16][2]. K % 32 == 0, N % 16 == 0.
void pack_transposed(int64_t G, int64_t N, int64_t K, const uint16_t* src, uint16_t* dst, int threads) {
  const int64_t panels = N / 16, pairs = K / 2;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < panels; ++p) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(src + (g * N + p * 16) * K);
      uint32_t* out = reinterpret_cast<uint32_t*>(dst + g * N * K + p * 16 * K);
      for (int64_t kp = 0; kp < pairs; kp += 16) transpose_16x16(w + kp, pairs, out + kp * 16, 16);
    }
}

// Aᵀ for G groups: group g is src rows [row0_g, row0_g + R_g) of a row-major (·, C) matrix; dst + dst_off_g gets
// its transpose (C, Rpad_g), the columns past R_g zero. Rpad_g % 32 == 0, C % 32 == 0. Per 32 rows × 32 columns:
// the row pairs interleaved (32-bit units), then two 16 × 16 transposes of those units.
void transpose_rows(int64_t G, const int64_t* row0, const int64_t* Rg, const int64_t* Rpad, int64_t C,
                    const uint16_t* src, uint16_t* dst, const int64_t* dst_off, int threads) {
  const int64_t col_blocks = C / 32;
  const __m512i index_lo = pair_index(0), index_hi = pair_index(16);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int64_t g = 0; g < G; ++g)
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      alignas(64) uint32_t pairs_lo[16 * 16], pairs_hi[16 * 16];
      const uint16_t* rows = src + row0[g] * C + cb * 32;
      uint16_t* out_lo = dst + dst_off[g] + cb * 32 * Rpad[g];
      uint16_t* out_hi = out_lo + 16 * Rpad[g];
      for (int64_t r0 = 0; r0 < Rpad[g]; r0 += 32) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t r = r0 + 2 * i;
          __m512i lo, hi;
          interleave_rows(r < Rg[g] ? rows + r * C : nullptr, r + 1 < Rg[g] ? rows + (r + 1) * C : nullptr, index_lo,
                          index_hi, lo, hi);
          _mm512_store_si512(pairs_lo + 16 * i, lo);
          _mm512_store_si512(pairs_hi + 16 * i, hi);
        }
        transpose_16x16(pairs_lo, 16, reinterpret_cast<uint32_t*>(out_lo + r0), Rpad[g] / 2);
        transpose_16x16(pairs_hi, 16, reinterpret_cast<uint32_t*>(out_hi + r0), Rpad[g] / 2);
      }
    }
}

}  // extern "C"
