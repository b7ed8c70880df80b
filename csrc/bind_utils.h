// Argument checks and layouts shared by the CPU and CUDA bindings (cpu/bind.cpp, cuda/bind.cpp).
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace fastbert {

inline void check_device(const at::Tensor& t, const at::Device& device, const char* what) {
  TORCH_CHECK(t.device() == device, "native kernel: ", what, " must be on ", device, ", got ", t.device());
}

// A [rows, n] view whose last dim is contiguous (a copy only when no such view exists).
inline at::Tensor as_rows(const at::Tensor& x, int64_t n) {
  if (x.dim() == 2 && x.size(1) == n && (x.stride(1) == 1 || n == 1)) return x;  // as it is: no dispatcher round trip
  // rows = the leading dims' product, spelled out when n == 0 (reshape cannot infer -1 from zero elements)
  const int64_t rows = n > 0 ? -1 : c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor v = x.reshape({rows, n});
  return (v.stride(1) == 1 || n == 1) ? v : v.contiguous();
}

// A parameter vector [n] as contiguous fp32 on `device`, 16-byte aligned (the CUDA kernels read it float4-wise).
inline at::Tensor params(const at::Tensor& p, int64_t n, const at::Device& device, const char* what) {
  check_device(p, device, what);
  TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == n, what, " must have shape [", n, "], got ", p.sizes());
  if (p.scalar_type() == at::kFloat && p.is_contiguous() && reinterpret_cast<uintptr_t>(p.data_ptr()) % 16 == 0)
    return p;  // as it is (the usual case): a layer stack passes 48 GEMMs' parameters a forward
  at::Tensor f = p.to(at::kFloat).contiguous();
  return reinterpret_cast<uintptr_t>(f.data_ptr()) % 16 == 0 ? f : f.clone();
}

// The output: a new contiguous tensor, or the caller's `out` (tests poison it to prove every element is written).
inline at::Tensor output(const std::optional<at::Tensor>& out, at::IntArrayRef sizes, const at::Tensor& like) {
  if (!out) return at::empty(sizes, like.options());
  TORCH_CHECK_VALUE(out->sizes() == sizes && out->scalar_type() == like.scalar_type() && out->is_contiguous() &&
                        out->device() == like.device(),
                    "out must be a contiguous ", like.scalar_type(), " tensor on ", like.device(), " of shape ", sizes,
                    ", got ", out->scalar_type(), " ", out->sizes(), " on ", out->device());
  return *out;
}

// Activation codes shared by both kernel sets: 0 erf GELU, 1 tanh GELU, 2 ReLU.
inline int act_code(const std::string& kind) {
  if (kind == "gelu") return 0;
  if (kind == "gelu_tanh") return 1;
  if (kind == "relu") return 2;
  TORCH_CHECK_VALUE(false, "unknown activation '", kind, "'; expected one of gelu, gelu_tanh, relu");
}

// The index type all three id tensors are converted to: int64 if any of them is, else int32.
inline at::ScalarType index_type(std::initializer_list<const at::Tensor*> ids) {
  for (const at::Tensor* t : ids) {
    if (t == nullptr) continue;
    TORCH_CHECK_TYPE(!t->is_floating_point() && !t->is_complex(), "ids must be integer, got ", t->scalar_type());
    if (t->scalar_type() == at::kLong) return at::kLong;
  }
  return at::kInt;
}

// Embedding tables must share the lead dtype and width: [rows, dim] with a contiguous last dim.
inline at::Tensor table(const at::Tensor& t, const at::Tensor& lead, int64_t dim, const char* what) {
  check_device(t, lead.device(), what);
  TORCH_CHECK_TYPE(t.scalar_type() == lead.scalar_type(), what, " must be ", lead.scalar_type(), ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(1) == dim, what, " must be [rows, ", dim, "], got ", t.sizes());
  return t.stride(1) == 1 ? t : t.contiguous();
}

}  // namespace fastbert
