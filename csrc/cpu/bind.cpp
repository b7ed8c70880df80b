// The torch-facing side of the CPU kernels: checks arguments, lays tensors out as the kernels expect, picks the
// kernel table for this CPU's ISA once at load, and binds with pybind11. Kernels live in *.inc (see kernels.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/python.h>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <exception>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../bind_utils.h"
#include "inputs.h"
#include "kernels.h"
#include "pool.h"

namespace fastbert::cpu {
namespace {

// Linux hands a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); asked once.
bool amx_granted() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
#else
  return false;
#endif
}

bool cpu_has(const char* isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
  if (std::string(isa) == "avx512amx")
    return bf16 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
           __builtin_cpu_supports("amx-bf16") && amx_granted();
  if (std::string(isa) == "avx512bf16") return bf16;
  if (std::string(isa) == "avx512vnni") return avx512 && __builtin_cpu_supports("avx512vnni");
  if (std::string(isa) == "avx512") return avx512;
  if (std::string(isa) == "avx2") return avx2;
#endif
  return std::string(isa) == "generic";
}

const KernelTable* table_of(const std::string& isa) {
#if defined(__x86_64__)
  if (isa == "avx512amx") return &kernels_avx512amx();
  if (isa == "avx512bf16") return &kernels_avx512bf16();
  if (isa == "avx512vnni") return &kernels_avx512vnni();
  if (isa == "avx512") return &kernels_avx512();
  if (isa == "avx2") return &kernels_avx2();
#endif
  if (isa == "generic") return &kernels_generic();
  return nullptr;
}

// The kernels in use: chosen at import, switched only by set_isa (tests). Atomic because kernels run without the GIL:
// a call reads it once where it tests an entry and then runs it.
std::atomic<const KernelTable*> active{nullptr};

const KernelTable& kernels() {
  const KernelTable* table = active.load();
  if (table == nullptr) {
    for (const char* isa : {"avx512amx", "avx512bf16", "avx512vnni", "avx512", "avx2", "generic"}) {
      if (cpu_has(isa)) {
        table = table_of(isa);
        break;
      }
    }
    active.store(table);
  }
  return *table;
}

// Select the kernels compiled for `isa` (tests run every path the CPU can execute); false if it cannot run here.
// cpu_has comes first: even building a table runs code compiled for that ISA.
bool set_isa(const std::string& isa) {
  if (!cpu_has(isa.c_str()) || table_of(isa) == nullptr) return false;
  active.store(table_of(isa));
  return true;
}

std::vector<std::string> runnable_isas() {
  std::vector<std::string> out;
  for (const char* isa : {"avx512amx", "avx512bf16", "avx512vnni", "avx512", "avx2", "generic"})
    if (cpu_has(isa) && table_of(isa) != nullptr) out.emplace_back(isa);
  return out;
}

DType dtype_of(const at::Tensor& t, const char* what) {
  if (t.scalar_type() == at::kFloat) return DType::f32;
  if (t.scalar_type() == at::kBFloat16) return DType::bf16;
  TORCH_CHECK_TYPE(false, "native CPU kernels take float32 or bfloat16, got ", what, " of ", t.scalar_type());
}

const at::Device kCpu(at::kCPU);

// The kernels' threads: torch's count within this process's affinity and cgroup quota (pool.h).
int max_threads() { return usable_threads(at::get_num_threads()); }

// Threads for `bytes` of memory-bound work: max_threads(), fewer when the job is too small to split.
int threads_for(int64_t bytes) {
  const int64_t by_size = std::max<int64_t>(1, bytes / (64 * 1024));
  return int(std::min<int64_t>(max_threads(), by_size));
}

// Flat contiguous ids of one index type, range-checked on the host (cheap on CPU; F.embedding raises the same way).
at::Tensor ids_of(const at::Tensor& ids, at::ScalarType type, int64_t rows, const char* what) {
  check_device(ids, kCpu, what);
  at::Tensor flat = ids.reshape({-1}).to(type).contiguous();
  if (flat.numel() > 0) {
    int64_t range[2];
    min_max(flat, range);
    TORCH_CHECK_INDEX(range[0] >= 0 && range[1] < rows, what, " out of range: [", range[0], ", ", range[1],
                      "] for a table of ", rows, " rows");
  }
  return flat;
}

at::Tensor embedding_layernorm(const std::optional<at::Tensor>& input_ids, const at::Tensor& token_type_ids,
                               const at::Tensor& position_ids, const at::Tensor& word_weight,
                               const at::Tensor& position_weight, const at::Tensor& type_weight,
                               const at::Tensor& ln_weight, const at::Tensor& ln_bias, double eps,
                               const std::optional<at::Tensor>& inputs_embeds,
                               const std::optional<at::Tensor>& out_opt) {
  TORCH_CHECK_VALUE(input_ids.has_value() != inputs_embeds.has_value(), "pass exactly one of input_ids, inputs_embeds");
  const at::Tensor& lead = inputs_embeds ? *inputs_embeds : word_weight;
  check_device(lead, kCpu, inputs_embeds ? "inputs_embeds" : "word_weight");
  const DType dtype = dtype_of(lead, inputs_embeds ? "inputs_embeds" : "word_weight");
  const int64_t dim = lead.size(-1);
  std::vector<int64_t> shape = inputs_embeds ? inputs_embeds->sizes().vec() : input_ids->sizes().vec();
  if (!inputs_embeds) shape.push_back(dim);
  const int64_t tokens = inputs_embeds ? inputs_embeds->numel() / std::max<int64_t>(dim, 1) : input_ids->numel();
  TORCH_CHECK_VALUE(token_type_ids.numel() == tokens && position_ids.numel() == tokens,
                    "token_type_ids and position_ids must have one entry per token (", tokens, ")");
  const at::ScalarType itype = index_type({input_ids ? &*input_ids : nullptr, &token_type_ids, &position_ids});
  at::Tensor words = inputs_embeds ? as_rows(*inputs_embeds, dim) : at::Tensor();
  at::Tensor ww = inputs_embeds ? at::Tensor() : table(word_weight, lead, dim, "word_weight");
  at::Tensor ids = inputs_embeds ? at::Tensor() : ids_of(*input_ids, itype, word_weight.size(0), "input_ids");
  at::Tensor tw = table(type_weight, lead, dim, "type_weight"), pw = table(position_weight, lead, dim, "pos_weight");
  at::Tensor tts = ids_of(token_type_ids, itype, type_weight.size(0), "token_type_ids");
  at::Tensor pos = ids_of(position_ids, itype, position_weight.size(0), "position_ids");
  at::Tensor w = params(ln_weight, dim, kCpu, "ln_weight"), b = params(ln_bias, dim, kCpu, "ln_bias");
  at::Tensor out = output(out_opt, shape, lead);
  if (tokens == 0 || dim == 0) return out;
  EmbeddingArgs a{};
  a.words = words.defined() ? words.data_ptr() : nullptr;
  a.words_stride = words.defined() ? words.stride(0) : 0;
  a.ids = ids.defined() ? ids.data_ptr() : nullptr;
  a.type_ids = tts.data_ptr();
  a.pos_ids = pos.data_ptr();
  a.ids_int64 = itype == at::kLong;
  a.word_weight = ww.defined() ? ww.data_ptr() : nullptr;
  a.word_stride = ww.defined() ? ww.stride(0) : 0;
  a.type_weight = tw.data_ptr();
  a.type_stride = tw.stride(0);
  a.pos_weight = pw.data_ptr();
  a.pos_stride = pw.stride(0);
  a.ln_weight = w.data_ptr<float>();
  a.ln_bias = b.data_ptr<float>();
  a.eps = float(eps);
  a.out = out.data_ptr();
  a.tokens = tokens;
  a.dim = dim;
  kernels().embedding_layernorm(a, dtype, threads_for(out.nbytes() * 4));
  return out;
}

at::Tensor bias_act(const at::Tensor& x, const at::Tensor& bias, const std::string& kind,
                    const std::optional<at::Tensor>& out_opt) {
  check_device(x, kCpu, "x");
  const DType dtype = dtype_of(x, "x");
  const Act act = Act(act_code(kind));
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must be [*, N], got a scalar");
  const int64_t n = x.size(-1);
  at::Tensor b = params(bias, n, kCpu, "bias");
  at::Tensor out = output(out_opt, x.sizes(), x);
  if (x.numel() == 0) return out;
  at::Tensor rows = as_rows(x, n);
  RowsArgs a{};
  a.x = rows.data_ptr();
  a.x_stride = rows.stride(0);
  a.bias = b.data_ptr<float>();
  a.act = act;
  a.out = out.data_ptr();
  a.rows = rows.size(0);
  a.n = n;
  kernels().bias_act(a, dtype, threads_for(out.nbytes() * (act == Act::relu ? 2 : 8)));
  return out;
}

// The gated ops' activations: bind_utils' codes and SiLU (SwiGLU's), which only the CPU kernels have.
Act gate_act(const std::string& kind) {
  if (kind == "silu") return Act::silu;
  TORCH_CHECK_VALUE(kind == "gelu" || kind == "gelu_tanh" || kind == "relu", "unknown activation '", kind,
                    "'; expected one of gelu, gelu_tanh, relu, silu");
  return Act(act_code(kind));
}

at::Tensor gated_act(const at::Tensor& x, const at::Tensor& up, const std::string& kind,
                     const std::optional<at::Tensor>& out_opt) {
  check_device(x, kCpu, "x");
  check_device(up, kCpu, "up");
  const DType dtype = dtype_of(x, "x");
  TORCH_CHECK_TYPE(up.scalar_type() == x.scalar_type(), "up must be ", x.scalar_type(), " like x, got ",
                   up.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && up.sizes() == x.sizes(), "x and up must be [*, N] of one shape, got ", x.sizes(),
                    " and ", up.sizes());
  const Act act = gate_act(kind);
  const int64_t n = x.size(-1);
  at::Tensor out = output(out_opt, x.sizes(), x);
  if (x.numel() == 0) return out;
  at::Tensor rows = as_rows(x, n), up_rows = as_rows(up, n);
  RowsArgs a{};
  a.x = rows.data_ptr();
  a.x_stride = rows.stride(0);
  a.up = up_rows.data_ptr();
  a.up_stride = up_rows.stride(0);
  a.act = act;
  a.out = out.data_ptr();
  a.rows = rows.size(0);
  a.n = n;
  kernels().gated_act(a, dtype, threads_for(out.nbytes() * (act == Act::relu ? 3 : 9)));
  return out;
}

at::Tensor bias_residual_layernorm(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                                   const at::Tensor& ln_weight, const at::Tensor& ln_bias, double eps,
                                   const std::optional<at::Tensor>& out_opt) {
  check_device(x, kCpu, "x");
  check_device(residual, kCpu, "residual");
  const DType dtype = dtype_of(x, "x");
  TORCH_CHECK_TYPE(residual.scalar_type() == x.scalar_type(), "residual must be ", x.scalar_type(), ", got ",
                   residual.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && residual.sizes() == x.sizes(), "x and residual must have the same shape, got ",
                    x.sizes(), " and ", residual.sizes());
  const int64_t n = x.size(-1);
  at::Tensor b = params(bias, n, kCpu, "bias"), w = params(ln_weight, n, kCpu, "ln_weight");
  at::Tensor lb = params(ln_bias, n, kCpu, "ln_bias");
  at::Tensor out = output(out_opt, x.sizes(), x);
  if (x.numel() == 0) return out;
  at::Tensor xr = as_rows(x, n), rr = as_rows(residual, n);
  RowsArgs a{};
  a.x = xr.data_ptr();
  a.x_stride = xr.stride(0);
  a.bias = b.data_ptr<float>();
  a.residual = rr.data_ptr();
  a.res_stride = rr.stride(0);
  a.ln_weight = w.data_ptr<float>();
  a.ln_bias = lb.data_ptr<float>();
  a.eps = float(eps);
  a.out = out.data_ptr();
  a.rows = xr.size(0);
  a.n = n;
  kernels().bias_residual_layernorm(a, dtype, threads_for(out.nbytes() * 3));
  return out;
}

// The kernels gather position_scores' key-side terms 16 rows at a time with int32 element offsets.
constexpr int64_t kMaxScoresStride = (int64_t(1) << 31) / 16;

// position_scores [2, nH, T, W] (fp32, or qkv's dtype) and position_columns [2R + 1] int32 with every column in
// [0, W), laid out as the kernels read them: W contiguous, stride(0) >= 1 (see attention.inc's bf16 gathers).
std::pair<at::Tensor, at::Tensor> position_scores_of(const at::Tensor& scores_in, const at::Tensor& columns_in,
                                                     const at::Tensor& qkv) {
  check_device(scores_in, kCpu, "position_scores");
  check_device(columns_in, kCpu, "position_columns");
  TORCH_CHECK_TYPE(scores_in.scalar_type() == at::kFloat || scores_in.scalar_type() == qkv.scalar_type(),
                   "position_scores must be float32 or qkv's dtype (", qkv.scalar_type(), "), got ",
                   scores_in.scalar_type());
  const int64_t total = qkv.size(0), heads = qkv.size(2);
  TORCH_CHECK_VALUE(scores_in.dim() == 4 && scores_in.size(0) == 2 && scores_in.size(1) == heads &&
                        scores_in.size(2) == total && scores_in.size(3) > 0,
                    "position_scores must be [2, nH = ", heads, ", T = ", total, ", W > 0], got ", scores_in.sizes());
  TORCH_CHECK_TYPE(columns_in.scalar_type() == at::kInt && columns_in.dim() == 1 && columns_in.numel() % 2 == 1,
                   "position_columns must be [2R + 1] int32, got ", columns_in.scalar_type(), " ", columns_in.sizes());
  const int64_t width = scores_in.size(3);
  at::Tensor columns = columns_in.contiguous();
  const int32_t* c = columns.data_ptr<int32_t>();
  for (int64_t i = 0; i < columns.numel(); ++i)
    TORCH_CHECK_INDEX(c[i] >= 0 && c[i] < width, "position_columns[", i, "] = ", c[i], " is outside [0, W = ", width,
                      ")");
  at::Tensor scores = scores_in;
  if (scores.stride(3) != 1 || scores.stride(0) == 0 || scores.stride(2) >= kMaxScoresStride)
    scores = scores.contiguous();
  TORCH_CHECK_VALUE(scores.stride(2) < kMaxScoresStride, "position_scores rows must be shorter than ",
                    kMaxScoresStride, " (the kernels gather with int32 offsets), got W = ", width);
  return {scores, columns};
}

// `batch_longest`: the longest sequence of the batch these sequences are a chunk of (encoder_layers), at most
// max_seqlen; the kernels choose their path and blocking by the longest sequence, so a chunk's rows come out as the
// whole batch's would.
at::Tensor attention(const at::Tensor& qkv_in, const at::Tensor& cu_seqlens, int64_t max_seqlen, double scale,
                     const std::optional<at::Tensor>& position_bias, const std::optional<at::Tensor>& position_scores,
                     const std::optional<at::Tensor>& position_columns, const std::optional<at::Tensor>& rotary_in,
                     std::optional<int64_t> window, const std::optional<at::Tensor>& out_opt, bool bf16_products,
                     int64_t batch_longest = 0) {
  check_device(qkv_in, kCpu, "qkv");
  check_device(cu_seqlens, kCpu, "cu_seqlens");
  const DType dtype = dtype_of(qkv_in, "qkv");
  TORCH_CHECK_VALUE(qkv_in.dim() == 4 && qkv_in.size(1) == 3, "qkv must be [T, 3, nH, D], got ", qkv_in.sizes());
  TORCH_CHECK_TYPE(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
                   "cu_seqlens must be a 1-D int32 tensor [B + 1], got ", cu_seqlens.scalar_type(), " ",
                   cu_seqlens.sizes());
  const int64_t total = qkv_in.size(0), heads = qkv_in.size(2), dim = qkv_in.size(3);
  at::Tensor cu = cu_seqlens.contiguous();
  const int32_t* c = cu.data_ptr<int32_t>();
  const int64_t batch = cu.numel() - 1;
  TORCH_CHECK_VALUE(c[0] == 0 && c[batch] == total, "cu_seqlens must run from 0 to T = ", total, ", got ", c[0],
                    " .. ", c[batch]);
  int64_t longest = 0;  // sizes the kernels' scratch: a generous max_seqlen must not allocate for it
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(c[b + 1] >= c[b] && c[b + 1] - c[b] <= max_seqlen, "sequence ", b, " has length ",
                      c[b + 1] - c[b], ": lengths must be in [0, max_seqlen = ", max_seqlen, "]");
    longest = std::max<int64_t>(longest, c[b + 1] - c[b]);
  }
  at::Tensor bias;
  if (position_bias.has_value()) {
    bias = *position_bias;
    check_device(bias, kCpu, "position_bias");
    TORCH_CHECK_TYPE(bias.scalar_type() == at::kFloat, "position_bias must be float32, got ", bias.scalar_type());
    TORCH_CHECK_VALUE(bias.dim() == 2 && bias.size(0) == heads && bias.size(1) % 2 == 1,
                      "position_bias must be [nH = ", heads, ", 2R + 1], got ", bias.sizes());
    bias = bias.contiguous();
  }
  TORCH_CHECK_VALUE(position_scores.has_value() == position_columns.has_value(),
                    "position_scores and position_columns come together");
  at::Tensor scores, columns;
  if (position_scores.has_value())
    std::tie(scores, columns) = position_scores_of(*position_scores, *position_columns, qkv_in);
  at::Tensor rotary;
  if (rotary_in.has_value()) {
    rotary = *rotary_in;
    check_device(rotary, kCpu, "rotary");
    TORCH_CHECK_TYPE(rotary.scalar_type() == at::kFloat, "rotary must be float32, got ", rotary.scalar_type());
    TORCH_CHECK_VALUE(rotary.dim() == 3 && rotary.size(0) == 2 && rotary.size(1) == total && rotary.size(2) > 0 &&
                          2 * rotary.size(2) <= dim,
                      "rotary must be [2, T = ", total, ", R/2] with 0 < R <= head dim ", dim, ", got ", rotary.sizes());
    if (rotary.stride(2) != 1) rotary = rotary.contiguous();
  }
  TORCH_CHECK_VALUE(!window.has_value() || *window >= 0, "window must be >= 0 (keys within that distance), got ",
                    window.value_or(0));
  at::Tensor out = output(out_opt, {total, heads, dim}, qkv_in);
  if (total == 0 || heads == 0 || dim == 0) return out;
  at::Tensor qkv = qkv_in.stride(3) == 1 ? qkv_in : qkv_in.contiguous();
  AttentionArgs a{};
  if (rotary.defined()) {
    a.rotary = rotary.data_ptr<float>();
    a.rotary_half = rotary.size(2);
    a.rotary_stride_side = rotary.stride(0);
    a.rotary_stride_t = rotary.stride(1);
  }
  a.window = window.value_or(-1);
  a.bf16_products = bf16_products && dtype == DType::f32;
  if (bias.defined()) a.bias = bias.data_ptr<float>(), a.bias_radius = (bias.size(1) - 1) / 2;
  if (scores.defined()) {
    a.scores = scores.data_ptr();
    a.scores_bf16 = scores.scalar_type() == at::kBFloat16;
    a.scores_stride_side = scores.stride(0);
    a.scores_stride_head = scores.stride(1);
    a.scores_stride_t = scores.stride(2);
    a.columns = columns.data_ptr<int32_t>();
    a.columns_radius = (columns.numel() - 1) / 2;
  }
  a.qkv = qkv.data_ptr();
  a.stride_t = qkv.stride(0);
  a.stride_which = qkv.stride(1);
  a.stride_head = qkv.stride(2);
  a.cu_seqlens = c;
  a.batch = batch;
  a.heads = heads;
  a.dim = dim;
  a.max_seqlen = std::max(longest, std::min(batch_longest, max_seqlen));
  a.scale = float(scale);
  a.out = out.data_ptr();
  kernels().attention(a, dtype, int(std::min<int64_t>(max_threads(), batch * heads)));
  return out;
}


// act(x @ W^T + bias), or LayerNorm(x @ W^T + bias + residual), W packed in panels of 16 columns (linear.inc): the
// shared checks and arguments of fp32_linear, bf16_linear and int8_linear. `k_per_step` is 1 (fp32), 2 (bf16 and int8
// pairs) or 4 (quads); x, the residual and out are `io` (bf16 for bf16_linear, else fp32).
// `gated`: 0, or the group of columns the weight's activated and up rows were interleaved in (then the output is
// act(x @ W_act^T + b_act) * (x @ W_up^T + b_up), [*, n / 2]); it must be the kernels' half tile.
at::Tensor run_linear(void (*kernel)(const LinearArgs&, int), const at::Tensor& x, const at::Tensor& packed,
                      at::ScalarType packed_type, int64_t k_per_step, int64_t n, const float* w_scale,
                      const std::optional<at::Tensor>& bias, const std::optional<std::string>& act,
                      const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& ln_weight,
                      const std::optional<at::Tensor>& ln_bias, double eps, const std::optional<at::Tensor>& out_opt,
                      int64_t gated, int64_t tile_cols, at::ScalarType io = at::kFloat,
                      const Handoff& handoff = {}) {
  check_device(x, kCpu, "x");
  check_device(packed, kCpu, "packed");
  const char* io_name = io == at::kFloat ? "float32" : "bfloat16";
  TORCH_CHECK_TYPE(x.scalar_type() == io, "x must be ", io_name, ", got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must be [*, K], got a scalar");
  const int64_t k = x.size(-1);
  const int64_t sum_steps = k_per_step == 4 ? 1 : 0;  // a quad pack's column sums, a step after each panel's k
  const int64_t parts = packed_type == at::kBFloat16 && io == at::kFloat ? 3 : 1;  // bf16x3: three bf16 packs
  const int64_t expected = (n + 31) / 32 * 32 * ((k + k_per_step - 1) / k_per_step + sum_steps) * k_per_step * parts;
  TORCH_CHECK_VALUE(packed.scalar_type() == packed_type && packed.is_contiguous() && packed.numel() == expected,
                    "packed must be the ", c10::toString(packed_type), " pack of an [", n, ", ", k, "] weight (",
                    expected, " elements), got ", packed.scalar_type(), " with ", packed.numel());
  at::Tensor b = bias ? params(*bias, n, kCpu, "bias") : at::Tensor();
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  if (gated != 0) {
    TORCH_CHECK_VALUE(gated == tile_cols / 2, "the weight was interleaved in groups of ", gated, " columns; these "
                      "kernels' tiles take groups of ", tile_cols / 2);
    TORCH_CHECK_VALUE(n % tile_cols == 0, "a gated GEMM's width must be whole tiles of ", tile_cols, ", got ", n);
    TORCH_CHECK_VALUE(act && !residual, "a gated GEMM takes an activation and no residual");
    shape.back() = n / 2;
  }
  at::Tensor rows = as_rows(x, k), res, lw, lb;
  if (residual) {
    check_device(*residual, kCpu, "residual");
    TORCH_CHECK_VALUE(residual->scalar_type() == io && residual->sizes() == at::IntArrayRef(shape),
                      "residual must be ", io_name, " of shape ", at::IntArrayRef(shape), ", got ",
                      residual->scalar_type(), " ", residual->sizes());
    TORCH_CHECK_VALUE(ln_weight && ln_bias, "a residual needs ln_weight and ln_bias (LayerNorm follows it)");
    TORCH_CHECK_VALUE(!act, "pass an activation or a residual + LayerNorm, not both");
    res = residual->is_contiguous() && residual->dim() == 2 ? *residual : residual->reshape({-1, n}).contiguous();
    lw = params(*ln_weight, n, kCpu, "ln_weight");
    lb = params(*ln_bias, n, kCpu, "ln_bias");
  }
  at::Tensor out = output(out_opt, shape, x);
  const int64_t m = rows.size(0);
  if (out.numel() == 0) return out;
  LinearArgs a{};
  a.x = rows.data_ptr();
  a.x_stride = rows.stride(0);
  a.weight = packed.data_ptr();
  a.w_scale = w_scale;
  a.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  a.gated = gated != 0;
  a.has_act = act.has_value();
  a.act = !act ? Act::gelu : (gated != 0 ? gate_act(*act) : Act(act_code(*act)));
  a.residual = res.defined() ? res.data_ptr() : nullptr;
  a.ln_weight = lw.defined() ? lw.data_ptr<float>() : nullptr;
  a.ln_bias = lb.defined() ? lb.data_ptr<float>() : nullptr;
  a.eps = float(eps);
  a.out = out.data_ptr();
  a.m = m;
  a.n = n;
  a.k = k;
  a.quantised_x = handoff.in;
  a.quantise_out = handoff.out;
  const int64_t macs = m * n * k;  // compute-bound: a thread per ~256k multiply-adds at least
  kernel(a, int(std::min<int64_t>(max_threads(), std::max<int64_t>(1, macs >> 18))));
  return out;
}

// fp32 x, fp32 W packed by fastbert.backends.gemm: see linear.inc.
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                       const std::optional<std::string>& act, const std::optional<at::Tensor>& residual,
                       const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
                       double eps, const std::optional<at::Tensor>& out, int64_t gated) {
  TORCH_CHECK_VALUE(n >= 0, "n must be >= 0, got ", n);
  const KernelTable& k = kernels();
  return run_linear(k.fp32_linear, x, packed, at::kFloat, 1, n, nullptr, bias, act, residual, ln_weight, ln_bias, eps,
                    out, gated, k.tile_cols);
}

// bf16 x, bf16 W packed by fastbert.backends.gemm in k pairs, on AMX tiles: see amx_bf16_linear.inc.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                       const std::optional<std::string>& act, const std::optional<at::Tensor>& residual,
                       const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
                       double eps, const std::optional<at::Tensor>& out) {
  TORCH_CHECK_VALUE(n >= 0, "n must be >= 0, got ", n);
  const KernelTable& k = kernels();
  TORCH_CHECK_VALUE(k.bf16_linear != nullptr, "bf16_linear needs AMX bf16 tiles; the ", k.isa,
                    " kernels in use have none (see has_bf16_linear())");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) % 32 == 0,
                    "bf16_linear takes K in whole tile steps of 32 (at least one), got ",
                    x.dim() >= 1 ? x.size(-1) : 0);
  return run_linear(k.bf16_linear, x, packed, at::kBFloat16, 2, n, nullptr, bias, act, residual, ln_weight, ln_bias,
                    eps, out, 0, k.tile_cols, at::kBFloat16);
}

// fp32 x, fp32 W as three bf16 parts packed by fastbert.backends.gemm, on AMX tiles: see amx_bf16x3_linear.inc.
at::Tensor bf16x3_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                         const std::optional<std::string>& act, const std::optional<at::Tensor>& residual,
                         const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
                         double eps, const std::optional<at::Tensor>& out) {
  TORCH_CHECK_VALUE(n >= 0, "n must be >= 0, got ", n);
  const KernelTable& k = kernels();
  TORCH_CHECK_VALUE(k.bf16x3_linear != nullptr, "bf16x3_linear needs AMX bf16 tiles; the ", k.isa,
                    " kernels in use have none (see has_bf16_linear())");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) % 32 == 0,
                    "bf16x3_linear takes K in whole tile steps of 32 (at least one), got ",
                    x.dim() >= 1 ? x.size(-1) : 0);
  return run_linear(k.bf16x3_linear, x, packed, at::kBFloat16, 2, n, nullptr, bias, act, residual, ln_weight, ln_bias,
                    eps, out, 0, k.tile_cols);
}

// k values per step of the int8 pack the kernels in use read fastest: 4 (int8 quads, u8 x s8 on VNNI) or 2 (pairs).
int64_t int8_k_per_step() { return kernels().int8_quad_linear != nullptr ? 4 : 2; }

// The longest K whose int32 sums cannot overflow: |qw| <= 127 times |qx| <= 127 (pairs) or qx + 128 <= 255 (quads,
// before the shift is taken back).
int64_t int8_max_k(bool quads) { return ((int64_t(1) << 31) - 1) / (127 * (quads ? 255 : 127)); }

// W int8 per channel (packed by fastbert.backends.int8: int16 pairs, or int8 quads where int8_k_per_step() is 4),
// x quantised to int8 per row here, or by the GEMM before where `handoff` says so (encoder_layers): see linear.inc.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias, const std::optional<std::string>& act,
                       const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& ln_weight,
                       const std::optional<at::Tensor>& ln_bias, double eps, const std::optional<at::Tensor>& out,
                       int64_t gated, const Handoff& handoff) {
  const int64_t n = w_scale.numel();
  at::Tensor ws = params(w_scale, n, kCpu, "w_scale");
  const bool quads = packed.scalar_type() == at::kChar;
  const int64_t k_max = int8_max_k(quads);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) <= k_max, "int8 GEMMs accumulate in int32: K must be at most ", k_max,
                    " for this pack, got ", x.dim() >= 1 ? x.size(-1) : 0);
  const KernelTable& k = kernels();
  if (quads) {
    TORCH_CHECK_VALUE(k.int8_quad_linear != nullptr, "an int8 quad pack needs the VNNI kernels; the ", k.isa,
                      " kernels in use read int16 pairs (see int8_k_per_step())");
    return run_linear(k.int8_quad_linear, x, packed, at::kChar, 4, n, ws.data_ptr<float>(), bias, act, residual,
                      ln_weight, ln_bias, eps, out, gated, k.tile_cols, at::kFloat, handoff);
  }
  TORCH_CHECK_VALUE(handoff.in.qx == nullptr && handoff.out.qx == nullptr, "quantised rows are handed on between "
                    "int8 quad GEMMs only");
  return run_linear(k.int8_linear, x, packed, at::kShort, 2, n, ws.data_ptr<float>(), bias, act, residual, ln_weight,
                    ln_bias, eps, out, gated, k.tile_cols);
}

#include "layer_stack.inc"

// The pool's claim protocol, checked: `jobs` jobs on `threads` threads, each counting its runs. Returns (every job
// ran exactly once, every slot was below `threads`, how many slots ran a job).
std::tuple<bool, bool, int> pool_cover(int64_t jobs, int threads) {
  TORCH_CHECK_VALUE(jobs >= 0 && threads >= 1, "jobs must be >= 0 and threads >= 1, got ", jobs, ", ", threads);
  std::vector<std::atomic<uint8_t>> runs(static_cast<size_t>(jobs));
  std::atomic<uint64_t> slots{0};
  std::atomic<bool> slots_ok{true};
  parallel_jobs(jobs, threads, [&](int64_t job, int slot) {
    runs[size_t(job)].fetch_add(1, std::memory_order_relaxed);
    if (slot < 0 || slot >= threads) slots_ok.store(false);
    slots.fetch_or(uint64_t(1) << std::min(slot, 63), std::memory_order_relaxed);
  });
  const bool once = std::all_of(runs.begin(), runs.end(), [](const std::atomic<uint8_t>& r) { return r.load() == 1; });
  return {once, slots_ok.load(), __builtin_popcountll(slots.load())};
}

}  // namespace
}  // namespace fastbert::cpu

// Every kernel runs without the GIL (its arguments are converted before, the result after): a server's other Python
// threads (tokenisation, I/O) run while a forward computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fastbert::cpu;
  m.doc() = "fastbert native CPU kernels (C++, OpenMP, runtime ISA dispatch)";
  kernels();  // pick the ISA once, at import, before any thread can race on it
  m.def("input_ranges", &input_ranges, "the input checks' values: (min, max) per id tensor, then the flags (inputs.h)",
        py::arg("ids"), py::arg("mask"), py::arg("pad_ends"), py::arg("pad_id"));
  m.def("mask_packing", &mask_packing, "a [B, S] mask's (longest, total, cu_seqlens, indices or None) (inputs.h)",
        py::arg("mask"));
  m.def("embedding_layernorm", &embedding_layernorm, "LayerNorm(word[ids] + pos[pos] + type[tt]) -> [*, E]",
        py::arg("input_ids"), py::arg("token_type_ids"), py::arg("position_ids"), py::arg("word_weight"),
        py::arg("position_weight"), py::arg("type_weight"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"),
        py::arg("inputs_embeds"), py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("bias_act", &bias_act, "act(x + bias)", py::arg("x"), py::arg("bias"), py::arg("kind"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("gated_act", &gated_act, "act(x) * up", py::arg("x"), py::arg("up"), py::arg("kind"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("bias_residual_layernorm", &bias_residual_layernorm, "LayerNorm(x + bias + residual)", py::arg("x"),
        py::arg("bias"), py::arg("residual"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("attention",
        [](const at::Tensor& qkv, const at::Tensor& cu_seqlens, int64_t max_seqlen, double scale,
           const std::optional<at::Tensor>& position_bias, const std::optional<at::Tensor>& position_scores,
           const std::optional<at::Tensor>& position_columns, const std::optional<at::Tensor>& rotary,
           std::optional<int64_t> window, const std::optional<at::Tensor>& out, bool bf16_products) {
          return attention(qkv, cu_seqlens, max_seqlen, scale, position_bias, position_scores, position_columns, rotary,
                           window, out, bf16_products);
        },
        "varlen attention over packed qkv [T, 3, nH, D] -> [T, nH, D]", py::arg("qkv"),
        py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("scale"), py::arg("position_bias") = py::none(),
        py::arg("position_scores") = py::none(), py::arg("position_columns") = py::none(),
        py::arg("rotary") = py::none(), py::arg("window") = py::none(), py::arg("out") = py::none(),
        py::arg("bf16_products") = false, py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear",
        [](const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
           const std::optional<at::Tensor>& bias, const std::optional<std::string>& act,
           const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& ln_weight,
           const std::optional<at::Tensor>& ln_bias, double eps, const std::optional<at::Tensor>& out,
           int64_t gated) { return int8_linear(x, packed, w_scale, bias, act, residual, ln_weight, ln_bias, eps, out,
                                               gated, Handoff{}); },
        "act(x @ W^T + bias) or LayerNorm(x @ W^T + bias + residual), W int8 per channel, x int8 per row",
        py::arg("x"), py::arg("packed"), py::arg("w_scale"), py::arg("bias") = py::none(), py::arg("act") = py::none(),
        py::arg("residual") = py::none(), py::arg("ln_weight") = py::none(), py::arg("ln_bias") = py::none(),
        py::arg("eps") = 1e-12, py::arg("out") = py::none(), py::arg("gated") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("fp32_linear", &fp32_linear,
        "act(x @ W^T + bias) or LayerNorm(x @ W^T + bias + residual), W fp32 packed in panels of 16 columns; with "
        "gated = gate_group(), W's activated and up rows interleaved in groups of that many: act(first) * second",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("act") = py::none(),
        py::arg("residual") = py::none(), py::arg("ln_weight") = py::none(), py::arg("ln_bias") = py::none(),
        py::arg("eps") = 1e-12, py::arg("out") = py::none(), py::arg("gated") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_linear", &bf16_linear,
        "act(x @ W^T + bias) or LayerNorm(x @ W^T + bias + residual) in bf16 on AMX tiles (fp32 sums and epilogue), "
        "W bf16 packed in panels of 16 columns and k pairs, K a multiple of 32",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("act") = py::none(),
        py::arg("residual") = py::none(), py::arg("ln_weight") = py::none(), py::arg("ln_bias") = py::none(),
        py::arg("eps") = 1e-12, py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("bf16x3_linear", &bf16x3_linear,
        "act(x @ W^T + bias) or LayerNorm(x @ W^T + bias + residual) in fp32 on AMX bf16 tiles: x and W split into "
        "three bf16 parts each, six products summed in fp32; W packed as three bf16 packs per panel, K a multiple of 32",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("act") = py::none(),
        py::arg("residual") = py::none(), py::arg("ln_weight") = py::none(), py::arg("ln_bias") = py::none(),
        py::arg("eps") = 1e-12, py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("has_bf16_linear", [] { return kernels().bf16_linear != nullptr; },
        "whether the kernels in use have the bf16 GEMM (AMX bf16 tiles)");
  m.def("gate_group", [] { return kernels().tile_cols / 2; },
        "the column group a gated GEMM's weight interleaves its activated and up rows in: half the kernels' tile");
  m.def("encoder_layers", &encoder_layers,
        "post-LN encoder layers in one call (inference), on the kernels the per-op path runs: [T, H] -> [T, H]",
        py::arg("x"), py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("heads"), py::arg("scale"),
        py::arg("weights"), py::arg("act"), py::arg("eps"), py::arg("position_bias") = py::none(),
        py::arg("bf16_products") = false, py::arg("chunks") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("encoder_layers_chunks", [] { return last_chunks; },
        "chunks the last encoder_layers call on this thread cut its batch into (1: the batch whole; 0: no call yet)");
  m.def(
      "sequence_chunks",
      [](const at::Tensor& cu_seqlens, int64_t hidden, int64_t inner, int64_t chunks) {
        TORCH_CHECK_TYPE(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 2,
                         "cu_seqlens must be a 1-D int32 tensor [B + 1], got ", cu_seqlens.scalar_type(), " ",
                         cu_seqlens.sizes());
        TORCH_CHECK_VALUE(chunks >= 1, "chunks must be >= 1, got ", chunks);
        const at::Tensor cu = cu_seqlens.contiguous();
        return sequence_chunks(cu.data_ptr<int32_t>(), cu.numel() - 1, hidden, inner, int(chunks));
      },
      "where encoder_layers cuts a batch into chunks of whole sequences: each chunk's first sequence, then B",
      py::arg("cu_seqlens"), py::arg("hidden"), py::arg("inner"), py::arg("chunks"));
  m.def("int8_k_per_step", &int8_k_per_step,
        "k values per step of the int8 weight pack the kernels in use take: 4 (int8 quads, VNNI) or 2 (int16 pairs)");
  m.def("int8_max_k", [] { return int8_max_k(int8_k_per_step() == 4); },
        "the longest K the int8 kernels in use take (int32 sums; int8_linear refuses a longer one)");
  m.def("isa", [] { return std::string(kernels().isa); }, "the instruction set of the kernels in use");
  m.def("set_isa", &set_isa, "use the kernels compiled for one ISA; False if this CPU cannot run them");
  m.def(
      "arithmetic_peak",
      [](const std::string& dtype, double seconds) -> py::object {
        TORCH_CHECK_VALUE(dtype == "fp32" || dtype == "bf16" || dtype == "amx_bf16",
                          "dtype must be 'fp32', 'bf16' or 'amx_bf16', got '", dtype, "'");
        TORCH_CHECK_VALUE(seconds > 0 && seconds <= 60, "seconds must be in (0, 60], got ", seconds);
        std::optional<double> peak;
        {
          py::gil_scoped_release release;
          peak = arithmetic_peak(dtype, at::get_num_threads(), seconds, cpu_has("avx512amx"));
        }
        return peak ? py::cast(*peak) : py::none();
      },
      "FLOP/s of fp32 FMAs, bf16 dot products or AMX bf16 tile products from registers on torch's threads: the "
      "CPU's arithmetic ceiling; None where the CPU lacks the instruction",
      py::arg("dtype"), py::arg("seconds") = 0.5);
  m.def(
      "threading",
      [] {
        std::string why;
        const int threads = usable_threads(at::get_num_threads(), &why);
        return py::make_tuple(threads, why, late_region_count(), busy_policy_name(), busy_spell_count(),
                              worker_count());
      },
      "(threads, what set that number, regions whose team came late, the busy-host policy, busy spells begun, "
      "fastbert's own threads started): pool.h");
  m.def("pool_cover", &pool_cover, "(every job ran once, every slot below threads, slots that ran): the pool's check",
        py::arg("jobs"), py::arg("threads"), py::call_guard<py::gil_scoped_release>());
  m.def("pool_judge", &judge_region, "end a region whose last team thread began this late (ns): pool.h's policy",
        py::arg("latest_start_ns"));
  m.def(
      "pool_set_policy",
      [](const std::string& name) {
        TORCH_CHECK_VALUE(set_busy_policy(name), "the busy-host policy must be pool, solo or off, got '", name, "'");
      },
      "what regions do while the machine is oversubscribed: pool, solo or off (pool.h)", py::arg("name"));
  m.def(
      "team_enter",
      [](bool outermost) {
        at::get_num_threads();  // torch's per-thread count set on this thread first (a new thread has the runtime's)
        team_enter(outermost);
      },
      "enter a forward's scope: torch's ops on this thread run on one thread fewer while a busy spell is on; "
      "outermost: a scope left without its leave (an interrupt past a hook) is closed first (pool.h)",
      py::arg("outermost") = false);
  m.def("team_leave", &team_leave, "leave it: the outermost leave gives the thread its team back (pool.h)");
  m.def(
      "pool_busy", [] { return oversubscribed() || team_narrowed(); },
      "whether a busy spell is on, or this thread's team is narrowed by one: regions follow the busy-host policy and "
      "GEMMs are not timed (pool.h)");
  m.def("pool_probe_in_ns", &probe_in_ns, "ns until a busy spell's next region probes the team (0: none due)");
  m.def("runnable_isas", &runnable_isas, "the ISAs compiled in that this CPU can run, best first");
  m.def("l2_cache_bytes", &l2_cache_bytes, "the per-core L2 size the GEMM's row panels are sized to (probed once)");
}
