// C ABI of the CUDA kernels in fused_ops.cu: raw pointers, element strides, a cudaStream_t passed as void*.
// Plain C so nvcc compiles the kernels without torch headers; bind.cpp (built only with torch+CUDA) calls these.
// Each returns 0, a cudaError_t from the launch, or FASTBERT_CUDA_UNSUPPORTED (row too long / bad dtype code).
#pragma once

#include <stdint.h>

#define FASTBERT_CUDA_UNSUPPORTED (-1)
#define FASTBERT_CUDA_MAX_ROW 8192  // longest LayerNorm row (elements) every path keeps in registers

#ifdef __cplusplus
extern "C" {
#endif

enum FastbertDType { FASTBERT_F32 = 0, FASTBERT_F16 = 1, FASTBERT_BF16 = 2 };
enum FastbertAct { FASTBERT_GELU = 0, FASTBERT_GELU_TANH = 1, FASTBERT_RELU = 2 };

// out[r, :] = act(x[r, :] + bias); x rows x_stride apart, out contiguous [rows, n].
int fastbert_cuda_bias_act(int dtype, int act, const void* x, int64_t x_stride, const float* bias, void* out,
                           int64_t rows, int64_t n, void* stream);

// out[r, :] = LayerNorm(x[r, :] + bias + residual[r, :]) * ln_weight + ln_bias, fp32 statistics.
int fastbert_cuda_bias_residual_layernorm(int dtype, const void* x, int64_t x_stride, const float* bias,
                                          const void* residual, int64_t res_stride, const float* ln_weight,
                                          const float* ln_bias, float eps, void* out, int64_t rows, int64_t n,
                                          void* stream);

// out[t, :] = LayerNorm(word[ids[t]] (or words[t, :]) + type[type_ids[t]] + pos[pos_ids[t]]), fp32 statistics.
// ids are int64 when index64 else int32; an out-of-range id makes that token's row NaN (no host sync to check).
// With `words` (inputs_embeds rows), ids and word_weight are unused and may be null.
int fastbert_cuda_embedding_layernorm(int dtype, int index64, const void* words, int64_t words_stride, const void* ids,
                                      const void* type_ids, const void* pos_ids, const void* word_weight,
                                      int64_t word_stride, int64_t vocab, const void* type_weight, int64_t type_stride,
                                      int64_t types, const void* pos_weight, int64_t pos_stride, int64_t positions,
                                      const float* ln_weight, const float* ln_bias, float eps, void* out,
                                      int64_t tokens, int64_t n, void* stream);

#ifdef __cplusplus
}
#endif
