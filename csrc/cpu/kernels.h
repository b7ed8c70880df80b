// The CPU kernels' C++ interface: raw pointers and sizes, no torch. Each ISA translation unit (isa_*.cpp) fills a
// KernelTable from the same sources (*.inc) compiled for its instruction set; bind.cpp picks one at load time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace fastbert::cpu {

enum class DType : int { f32 = 0, bf16 = 1 };
enum class Act : int { gelu = 0, gelu_tanh = 1, relu = 2, silu = 3 };  // silu: the gated ops only

struct EmbeddingArgs {
  const void* words;          // [T, E] rows of inputs_embeds, or null to gather word_weight[ids]
  int64_t words_stride;       // row stride of `words` in elements
  const void* ids;            // [T] int32/int64 word ids (when words is null)
  const void* type_ids;       // [T] int32/int64
  const void* pos_ids;        // [T] int32/int64
  bool ids_int64;             // all three id arrays share this index type
  const void* word_weight;    // [V, E]
  const void* type_weight;    // [Tt, E]
  const void* pos_weight;     // [P, E]
  int64_t word_stride, type_stride, pos_stride;  // row strides of the three tables
  const float* ln_weight;     // [E] fp32
  const float* ln_bias;       // [E] fp32
  float eps;
  void* out;                  // [T, E] contiguous
  int64_t tokens, dim;
};

struct RowsArgs {
  const void* x;              // [R, N], row stride x_stride
  int64_t x_stride;
  const float* bias;          // [N] fp32
  const void* residual;       // [R, N] row stride res_stride (bias_residual_layernorm only)
  int64_t res_stride;
  const float* ln_weight;     // [N] fp32 (bias_residual_layernorm only)
  const float* ln_bias;       // [N] fp32
  float eps;
  Act act;                    // bias_act and gated_act
  const void* up;             // [R, N] row stride up_stride, x's dtype (gated_act only: act(x) * up)
  int64_t up_stride;
  void* out;                  // [R, N] contiguous
  int64_t rows, n;
};

struct AttentionArgs {
  const void* qkv;            // [T, 3, nH, D], last dim contiguous
  int64_t stride_t, stride_which, stride_head;  // element strides of the first three dims
  const int32_t* cu_seqlens;  // [B + 1], validated by the caller
  int64_t batch, heads, dim, max_seqlen;
  float scale;
  const float* bias;          // [nH, 2R + 1] contiguous: added to the score at distance clamp(j - i, -R, R) + R; or null
  int64_t bias_radius;        // R
  // DeBERTa's disentangled terms, or null: query i and key j (packed rows) add scores[0, h, i, c] + scores[1, h, j, c]
  // with c = columns[clamp(j - i, -R, R) + R]
  const void* scores;         // [2, nH, T, W] fp32 or bf16 (scores_bf16), last dim contiguous, stride(0) >= 1
  bool scores_bf16;
  int64_t scores_stride_side, scores_stride_head, scores_stride_t;  // element strides of the first three dims
  const int32_t* columns;     // [2R + 1], each in [0, W)
  int64_t columns_radius;     // R
  // rotary positions, or null: q and k of packed token t rotated by cos = rotary[t * rotary_stride_t + d] and
  // sin = the same + rotary_stride_side, pairs (d, d + rotary_half) for d < rotary_half
  const float* rotary;
  int64_t rotary_half, rotary_stride_side, rotary_stride_t;
  int64_t window;             // keys with |j - i| <= window only; < 0: every key
  bool bf16_products;         // fp32 qkv whose two products may round q, k, v and P to bf16 (an int8 model's
                              // attention, its error well under its GEMMs'): on AMX tiles where those run, else exact
  void* out;                  // [T, nH, D] contiguous
};

// x's rows quantised to u8 for an int8 quad GEMM: qx [rows][ceil(K / 4)] words, sx [M] (see LinearArgs)
struct QuantisedRowsRef {
  int32_t* qx = nullptr;
  float* sx = nullptr;
};

// What an int8 quad GEMM takes quantised from the GEMM before, and what it hands on (encoder_layers; LinearArgs)
struct Handoff {
  QuantisedRowsRef in, out;
};

// out = act(x @ W^T + bias), or LayerNorm(x @ W^T + bias + residual), W packed in panels (linear.inc). x, the
// residual and out are fp32, but bf16 for bf16_linear (the `*32` accessors: the fp32 kernels' typed view).
// bf16x3_linear's W is three bf16 packs of bf16_linear's layout, [ceil(N / 32) * 2][3][K / 2][16][2].
struct LinearArgs {
  const void* x;              // [M, K], row stride x_stride
  int64_t x_stride;
  const void* weight;         // packed panels: fp32 [ceil(N / 32) * 2][K][16] (fp32_linear), bf16 [ceil(N / 32) *
                              // 2][K / 2][16][2] (bf16_linear, K a multiple of 32), int8 values as int16
                              // [ceil(N / 32) * 2][ceil(K / 2)][16][2] (int8_linear), or as int8
                              // [ceil(N / 32) * 2][ceil(K / 4) + 1][16][4] (int8_quad_linear; the last step of
                              // each panel: its 16 columns' 128 sum_k qw[n, k] as int32)
  const float* w_scale;       // [N] per output channel (int8 only)
  const float* bias;          // [N] or null
  bool gated;                 // columns interleaved in groups of kTileCols / 2, act group then up group: the tile
                              // writes act(first) * second, so out is [M, N / 2] (act set, no residual)
  bool has_act;
  Act act;                    // applied when has_act
  const void* residual;       // [M, N] contiguous, or null; with it, LayerNorm(ln_weight, ln_bias, eps) follows
  const float* ln_weight;     // [N]
  const float* ln_bias;       // [N]
  float eps;
  void* out;                  // [M, N] contiguous
  int64_t m, n, k;
  // int8 quads only (the layer stack hands a LayerNorm's rows to the next GEMM quantised), else null: x already
  // quantised as this GEMM would quantise it (qx: u8 rows of ceil(K / 4) words, rows up to a whole block of 32 set to
  // the code of 0, 128; sx: [M] scales); and, with a residual, where to write the LayerNorm's output rows quantised
  // the same way for the GEMM that reads them next
  QuantisedRowsRef quantised_x, quantise_out;

  const float* x32() const { return static_cast<const float*>(x); }
  const float* residual32() const { return static_cast<const float*>(residual); }
  float* out32() const { return static_cast<float*>(out); }
};

struct KernelTable {
  const char* isa;
  void (*embedding_layernorm)(const EmbeddingArgs&, DType, int threads);
  void (*bias_act)(const RowsArgs&, DType, int threads);
  void (*bias_residual_layernorm)(const RowsArgs&, DType, int threads);
  void (*attention)(const AttentionArgs&, DType, int threads);
  void (*fp32_linear)(const LinearArgs&, int threads);
  void (*int8_linear)(const LinearArgs&, int threads);
  void (*int8_quad_linear)(const LinearArgs&, int threads);  // null where the ISA has no u8 x s8 dot product (VNNI)
  void (*bf16_linear)(const LinearArgs&, int threads);       // null where the ISA has no AMX bf16 tiles
  void (*bf16x3_linear)(const LinearArgs&, int threads);     // fp32 on AMX bf16 tiles; null without them
  void (*gated_act)(const RowsArgs&, DType, int threads);
  int64_t tile_cols;          // output columns per GEMM tile: a gated weight interleaves groups of half of it
};

const KernelTable& kernels_avx512amx();
const KernelTable& kernels_avx512bf16();
const KernelTable& kernels_avx512vnni();
const KernelTable& kernels_avx512();
const KernelTable& kernels_avx2();
const KernelTable& kernels_generic();

// The per-core L2 size in bytes, probed once (sysconf; 256 KiB, the smallest L2 of current x86 cores, where it says
// nothing): the GEMM's row panels are sized to it (bind.cpp).
int64_t l2_cache_bytes();

// FLOP/s of `threads` threads running fp32 FMAs ("fp32"), bf16 dot products ("bf16") or AMX bf16 tile products
// ("amx_bf16", where `amx`: the tile state is granted) from registers for about `seconds`: the arithmetic ceiling no
// GEMM can pass. nullopt where this CPU lacks the instruction (peak.cpp).
std::optional<double> arithmetic_peak(const std::string& dtype, int threads, double seconds, bool amx);

}  // namespace fastbert::cpu
