// CUDA kernels for the memory-bound fused ops (embedding+LayerNorm, bias+activation, bias+residual+LayerNorm).
// One pass over memory: each row is read once into registers, reduced, normalised and written once. Accesses are
// 16 bytes wide (float4 / 8 halves) whenever the row length, row strides and base pointers allow it; a scalar
// variant covers the rest. fp32, fp16 and bf16 storage; fp32 math and LayerNorm statistics; one rounding on store.
// Limits: LayerNorm rows of at most FASTBERT_CUDA_MAX_ROW elements (launch.h); ops take no dropout; the fp32
// parameter vectors (bias, LayerNorm weight and bias) must be 16-byte aligned (bind.cpp makes sure).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>

#include <type_traits>

#include "launch.h"

namespace {

constexpr int kMaxThreads = 1024;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// V elements moved as one access: 16 bytes when V * sizeof(T) == 16.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(pk.v[i]);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int i = 0; i < V; ++i) pk.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

// V fp32 parameters (bias, LayerNorm weight) from a 16-byte aligned vector, float4 at a time when V allows.
template <int V>
__device__ __forceinline__ void load_params(const float* __restrict__ p, float (&out)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + i);
      out[i] = q.x, out[i + 1] = q.y, out[i + 2] = q.z, out[i + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = p[i];
  }
}

// Sum over the block (blockDim.x a multiple of 32), returned to every thread.
__device__ __forceinline__ float block_sum(float v, float* partial /* [32] shared */) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // the previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x / 32) ? partial[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// LayerNorm of one row held in registers: thread t owns elements [(it * blockDim + t) * V, +V) for it < ITEMS.
// `fill(c, h)` writes the fused fp32 inputs of elements [c, c + V) into h.
template <typename T, int V, int ITEMS, typename Fill>
__device__ __forceinline__ void layernorm_row(Fill fill, const float* __restrict__ w, const float* __restrict__ b,
                                              float eps, T* __restrict__ out, int64_t n) {
  __shared__ float partial[32];
  float h[ITEMS][V];
  float sum = 0.0f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int64_t c = (int64_t(it) * blockDim.x + threadIdx.x) * V;
    if (c < n) {
      fill(c, h[it]);
#pragma unroll
      for (int i = 0; i < V; ++i) sum += h[it][i];
    }
  }
  const float mean = block_sum(sum, partial) / float(n);
  float sq = 0.0f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int64_t c = (int64_t(it) * blockDim.x + threadIdx.x) * V;
    if (c < n) {
#pragma unroll
      for (int i = 0; i < V; ++i) sq += (h[it][i] - mean) * (h[it][i] - mean);
    }
  }
  const float rstd = rsqrtf(block_sum(sq, partial) / float(n) + eps);
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int64_t c = (int64_t(it) * blockDim.x + threadIdx.x) * V;
    if (c < n) {
      float y[V], wv[V], bv[V];
      load_params<V>(w + c, wv);
      load_params<V>(b + c, bv);
#pragma unroll
      for (int i = 0; i < V; ++i) y[i] = (h[it][i] - mean) * rstd * wv[i] + bv[i];
      store_vec<T, V>(out + c, y);
    }
  }
}

template <typename T, int V, int ITEMS>
__global__ void __launch_bounds__(kMaxThreads)
    bias_residual_layernorm_kernel(const T* __restrict__ x, int64_t x_stride,  // [rows, n]
                                   const float* __restrict__ bias,              // [n]
                                   const T* __restrict__ res, int64_t res_stride,  // [rows, n]
                                   const float* __restrict__ w, const float* __restrict__ b, float eps,
                                   T* __restrict__ out, int64_t n) {  // out [rows, n] contiguous
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const T* rr = res + row * res_stride;
  auto fill = [&](int64_t c, float (&h)[V]) {
    float a[V], r[V], bv[V];
    load_vec<T, V>(xr + c, a);
    load_vec<T, V>(rr + c, r);
    load_params<V>(bias + c, bv);
#pragma unroll
    for (int i = 0; i < V; ++i) h[i] = a[i] + bv[i] + r[i];
  };
  layernorm_row<T, V, ITEMS>(fill, w, b, eps, out + row * n, n);
}

template <typename T, typename I, int V, int ITEMS>
__global__ void __launch_bounds__(kMaxThreads)
    embedding_layernorm_kernel(const T* __restrict__ words, int64_t words_stride,  // [tokens, n] or null
                               const I* __restrict__ ids, const I* __restrict__ type_ids,
                               const I* __restrict__ pos_ids,  // [tokens] each
                               const T* __restrict__ ww, int64_t w_stride, int64_t vocab,  // [vocab, n]
                               const T* __restrict__ tw, int64_t t_stride, int64_t types,  // [types, n]
                               const T* __restrict__ pw, int64_t p_stride, int64_t positions,
                               const float* __restrict__ lw, const float* __restrict__ lb, float eps,
                               T* __restrict__ out, int64_t n) {  // out [tokens, n] contiguous
  const int64_t t = blockIdx.x;
  const int64_t id = words != nullptr ? 0 : int64_t(ids[t]), tt = type_ids[t], pos = pos_ids[t];
  T* orow = out + t * n;
  if (id < 0 || id >= vocab || tt < 0 || tt >= types || pos < 0 || pos >= positions) {  // uniform across the block
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) orow[c] = from_float<T>(__int_as_float(0x7fc00000));
    return;
  }
  const T* wr = words != nullptr ? words + t * words_stride : ww + id * w_stride;
  const T* tr = tw + tt * t_stride;
  const T* pr = pw + pos * p_stride;
  auto fill = [&](int64_t c, float (&h)[V]) {
    float a[V], ty[V], p[V];
    load_vec<T, V>(wr + c, a);
    load_vec<T, V>(tr + c, ty);
    load_vec<T, V>(pr + c, p);
#pragma unroll
    for (int i = 0; i < V; ++i) h[i] = a[i] + ty[i] + p[i];
  };
  layernorm_row<T, V, ITEMS>(fill, lw, lb, eps, orow, n);
}

template <int ACT>
__device__ __forceinline__ float activate(float x) {
  if (ACT == FASTBERT_GELU) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
  if (ACT == FASTBERT_GELU_TANH) return x / (1.0f + expf(-1.5957691216057308f * (x + 0.044715f * x * x * x)));
  return x < 0.0f ? 0.0f : x;  // NaN passes through, as in torch
}

template <typename T, int V, int ACT>
__global__ void bias_act_kernel(const T* __restrict__ x, int64_t x_stride,  // [rows, n]
                                const float* __restrict__ bias,             // [n]
                                T* __restrict__ out, int64_t rows, int64_t n) {  // out [rows, n] contiguous
  const int64_t per_row = n / V, total = rows * per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i - r * per_row) * V;
    float a[V], bv[V];
    load_vec<T, V>(x + r * x_stride + c, a);
    load_params<V>(bias + c, bv);
#pragma unroll
    for (int k = 0; k < V; ++k) a[k] = activate<ACT>(a[k] + bv[k]);
    store_vec<T, V>(out + r * n + c, a);
  }
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Elements per 16-byte access when the whole layout allows it, else 1.
template <typename T>
int vec_width(int64_t n, const void* a, int64_t a_stride, const void* b, int64_t b_stride, const void* out) {
  constexpr int v = 16 / sizeof(T);
  const bool strides = n % v == 0 && a_stride % v == 0 && b_stride % v == 0;
  const bool ok = strides && aligned16(a) && aligned16(b) && aligned16(out);
  return ok ? v : 1;
}

// Threads and register items per thread for a LayerNorm row of `n` elements moved `v` at a time.
bool ln_launch(int64_t n, int v, int* items, int* threads) {
  const int64_t vecs = (n + v - 1) / v;
  for (int it = 1; it <= 8; it *= 2) {
    if (vecs <= int64_t(kMaxThreads) * it) {
      *items = it;
      *threads = int(((vecs + it - 1) / it + 31) / 32 * 32);
      return n <= FASTBERT_CUDA_MAX_ROW;
    }
  }
  return false;
}

int launched() { return int(cudaGetLastError()); }

template <int N>
using Int = std::integral_constant<int, N>;

// Call f(T{}) for the storage type named by a FastbertDType code.
template <typename F>
int with_dtype(int dtype, F&& f) {
  switch (dtype) {
    case FASTBERT_F32: return f(float{});
    case FASTBERT_F16: return f(__half{});
    case FASTBERT_BF16: return f(__nv_bfloat16{});
    default: return FASTBERT_CUDA_UNSUPPORTED;
  }
}

// Call f(Int<V>{}) with V = 16 / sizeof(T) (vector path) or 1 (scalar path).
template <typename T, typename F>
int with_width(int v, F&& f) {
  return v == 1 ? f(Int<1>{}) : f(Int<16 / sizeof(T)>{});
}

// Call f(Int<ITEMS>{}) for ITEMS in {1, 2, 4, 8}.
template <typename F>
int with_items(int items, F&& f) {
  switch (items) {
    case 1: return f(Int<1>{});
    case 2: return f(Int<2>{});
    case 4: return f(Int<4>{});
    default: return f(Int<8>{});
  }
}

}  // namespace

extern "C" int fastbert_cuda_bias_act(int dtype, int act, const void* x, int64_t x_stride, const float* bias,
                                      void* out, int64_t rows, int64_t n, void* stream) {
  if (rows == 0 || n == 0) return 0;
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return with_width<T>(vec_width<T>(n, x, x_stride, nullptr, 0, out), [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int64_t work = rows * (n / V);
      const unsigned blocks = unsigned(work / 256 + 1 < 8192 ? work / 256 + 1 : 8192);
      auto launch = [&](auto kernel) {
        kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<const T*>(x), x_stride, bias,
                                                                       static_cast<T*>(out), rows, n);
        return launched();
      };
      switch (act) {
        case FASTBERT_GELU: return launch(bias_act_kernel<T, V, FASTBERT_GELU>);
        case FASTBERT_GELU_TANH: return launch(bias_act_kernel<T, V, FASTBERT_GELU_TANH>);
        case FASTBERT_RELU: return launch(bias_act_kernel<T, V, FASTBERT_RELU>);
        default: return FASTBERT_CUDA_UNSUPPORTED;
      }
    });
  });
}

extern "C" int fastbert_cuda_bias_residual_layernorm(int dtype, const void* x, int64_t x_stride, const float* bias,
                                                     const void* residual, int64_t res_stride, const float* ln_weight,
                                                     const float* ln_bias, float eps, void* out, int64_t rows,
                                                     int64_t n, void* stream) {
  if (rows == 0 || n == 0) return 0;
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const int width = vec_width<T>(n, x, x_stride, residual, res_stride, out);
    int items = 0, threads = 0;
    if (!ln_launch(n, width, &items, &threads)) return FASTBERT_CUDA_UNSUPPORTED;
    return with_width<T>(width, [&](auto v) {
      return with_items(items, [&](auto it) {
        constexpr int V = decltype(v)::value, ITEMS = decltype(it)::value;
        bias_residual_layernorm_kernel<T, V, ITEMS><<<unsigned(rows), threads, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const T*>(x), x_stride, bias, static_cast<const T*>(residual), res_stride, ln_weight, ln_bias,
            eps, static_cast<T*>(out), n);
        return launched();
      });
    });
  });
}

extern "C" int fastbert_cuda_embedding_layernorm(int dtype, int index64, const void* words, int64_t words_stride,
                                                 const void* ids, const void* type_ids, const void* pos_ids,
                                                 const void* word_weight, int64_t word_stride, int64_t vocab,
                                                 const void* type_weight, int64_t type_stride, int64_t types,
                                                 const void* pos_weight, int64_t pos_stride, int64_t positions,
                                                 const float* ln_weight, const float* ln_bias, float eps, void* out,
                                                 int64_t tokens, int64_t n, void* stream) {
  if (tokens == 0 || n == 0) return 0;
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const void* rows = words != nullptr ? words : word_weight;
    const int64_t rows_stride = words != nullptr ? words_stride : word_stride;
    int width = vec_width<T>(n, rows, rows_stride, type_weight, type_stride, out);
    width = vec_width<T>(n, pos_weight, pos_stride, nullptr, 0, nullptr) == 1 ? 1 : width;
    int items = 0, threads = 0;
    if (!ln_launch(n, width, &items, &threads)) return FASTBERT_CUDA_UNSUPPORTED;
    return with_width<T>(width, [&](auto v) {
      return with_items(items, [&](auto it) {
        constexpr int V = decltype(v)::value, ITEMS = decltype(it)::value;
        auto launch = [&](auto index) {
          using I = decltype(index);
          embedding_layernorm_kernel<T, I, V, ITEMS><<<unsigned(tokens), threads, 0,
                                                       static_cast<cudaStream_t>(stream)>>>(
              static_cast<const T*>(words), words_stride, static_cast<const I*>(ids), static_cast<const I*>(type_ids),
              static_cast<const I*>(pos_ids), static_cast<const T*>(word_weight), word_stride, vocab,
              static_cast<const T*>(type_weight), type_stride, types, static_cast<const T*>(pos_weight), pos_stride,
              positions, ln_weight, ln_bias, eps, static_cast<T*>(out), n);
          return launched();
        };
        return index64 ? launch(int64_t{}) : launch(int32_t{});
      });
    });
  });
}
