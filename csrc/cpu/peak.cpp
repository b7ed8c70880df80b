// The CPU's arithmetic ceiling: fp32 FMA, bf16 dot-product and AMX bf16 tile throughput of a loop that never touches
// memory. The
// model suite prints it beside the measured matmul peak, so a GEMM's efficiency reads against the silicon, not
// against another library. Also the L2 size the GEMM's blocking reads.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace fastbert::cpu {
namespace {

// Independent accumulator chains per thread: more than FMA latency (4 cycles) x FMA pipes (2) on current x86 cores,
// so the loop is throughput-bound, and few enough (12 of 16 / 32 vector registers) to stay in registers.
constexpr int kChains = 12;

#if defined(__x86_64__)
// One probe loop for every vector type: kChains independent chains of `update(a)`, then every lane summed so the
// loop stays live. A macro, not a template or a lambda: the loop must be compiled under its function's target().
#define FASTBERT_PROBE(Vec, init, update, store, lanes_per_vec)                    \
  Vec acc[kChains];                                                                \
  for (int i = 0; i < kChains; ++i) acc[i] = init(float(i));                       \
  for (int64_t k = 0; k < iters; ++k) {                                            \
    _Pragma("GCC unroll 12") for (int i = 0; i < kChains; ++i) {                   \
      Vec a = acc[i];                                                              \
      acc[i] = update;                                                             \
    }                                                                              \
  }                                                                                \
  alignas(64) float lanes[kChains * lanes_per_vec];                                \
  for (int i = 0; i < kChains; ++i) store(lanes + i * lanes_per_vec, acc[i]);      \
  float sum = 0.f;                                                                 \
  for (float v : lanes) sum += v;                                                  \
  return sum;

__attribute__((target("avx512f"))) float fma_avx512(int64_t iters) {
  const __m512 scale = _mm512_set1_ps(0.999999f), shift = _mm512_set1_ps(1e-6f);
  FASTBERT_PROBE(__m512, _mm512_set1_ps, _mm512_fmadd_ps(a, scale, shift), _mm512_store_ps, 16)
}

__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iters) {
  const __m256 scale = _mm256_set1_ps(0.999999f), shift = _mm256_set1_ps(1e-6f);
  FASTBERT_PROBE(__m256, _mm256_set1_ps, _mm256_fmadd_ps(a, scale, shift), _mm256_store_ps, 8)
}

// vdpbf16ps: per fp32 lane, acc += x[2i] * y[2i] + x[2i+1] * y[2i+1], so 4 FLOP per lane per instruction.
__attribute__((target("avx512f,avx512bf16"))) float dot_bf16_avx512(int64_t iters) {
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3380);  // 1.0, ~6e-8
  FASTBERT_PROBE(__m512, _mm512_set1_ps, _mm512_dpbf16_ps(a, x, y), _mm512_store_ps, 16)
}
#undef FASTBERT_PROBE

// tdpbf16ps on tiles held in the tile registers: 16 x 16 fp32 sums of 32 bf16 products, 16,384 FLOP an instruction,
// four independent accumulator tiles (the products' latency) from two operand tiles each. The caller has been granted
// the tile state (bind.cpp asks Linux before it picks the AMX kernels).
__attribute__((target("amx-tile,amx-bf16"))) float tiles_bf16(int64_t iters) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  alignas(64) static const uint16_t ones[16 * 32] = {};  // zeros: the sums stay 0, the work is the same
  alignas(64) float sums[16 * 16];
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  for (int64_t k = 0; k < iters; ++k) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums, 64);
  _tile_release();
  return sums[0];
}
#endif

struct Probe {
  float (*run)(int64_t);
  double flops_per_iter;  // per thread: chains x lanes x FLOP per lane
};

std::optional<Probe> probe_for(const std::string& dtype, bool amx) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  if (dtype == "bf16" && avx512 && __builtin_cpu_supports("avx512bf16")) return Probe{dot_bf16_avx512, kChains * 64.0};
  if (dtype == "amx_bf16" && amx) return Probe{tiles_bf16, 4 * 16 * 16 * 32 * 2.0};
  if (dtype == "fp32" && avx512) return Probe{fma_avx512, kChains * 32.0};
  if (dtype == "fp32" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return Probe{fma_avx2, kChains * 16.0};
#endif
  return std::nullopt;
}

struct Timing {
  double seconds;
  int team;  // threads OpenMP actually ran (it may start fewer than asked)
};

Timing time_probe(const Probe& probe, int64_t iters, int threads, float* sink) {
  const auto start = std::chrono::steady_clock::now();
  float total = 0.f;
  int team = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total, team)
  {
    total += probe.run(iters);
    team += 1;
  }
  *sink += total;
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), team};
}

}  // namespace

std::optional<double> arithmetic_peak(const std::string& dtype, int threads, double seconds, bool amx) {
  const std::optional<Probe> probe = probe_for(dtype, amx);
  if (!probe) return std::nullopt;
  float sink = 0.f;
  int64_t iters = 1 << 12;
  Timing run = time_probe(*probe, iters, threads, &sink);
  while (run.seconds < seconds / 32) {  // grow until one run is long enough to time
    iters *= 4;
    run = time_probe(*probe, iters, threads, &sink);
  }
  iters = int64_t(double(iters) * seconds / 4 / run.seconds) + 1;
  double best = 0.0;  // FLOP/s; a busy neighbour only slows a run, so the fastest is the ceiling
  for (int rep = 0; rep < 4; ++rep) {
    run = time_probe(*probe, iters, threads, &sink);
    best = std::max(best, probe->flops_per_iter * double(iters) * run.team / run.seconds);
  }
  volatile float keep = sink;  // the accumulators' sum is observable: the loops stay live
  (void)keep;
  return best;
}

int64_t l2_cache_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long probed = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (probed > 0) return int64_t(probed);
#endif
    return int64_t(256) << 10;
  }();
  return bytes;
}

}  // namespace fastbert::cpu
