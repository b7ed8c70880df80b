// The torch-facing side of the CUDA kernels (fused_ops.cu): checks arguments, lays tensors out, launches on the
// current stream through the C ABI of launch.h, and binds with pybind11. Built only where torch has CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/python.h>

#include <string>

#include "../bind_utils.h"
#include "launch.h"

namespace fastbert::cuda {
namespace {

int dtype_code(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda(), "native CUDA kernel: ", what, " must be a CUDA tensor, got ", t.device());
  if (t.scalar_type() == at::kFloat) return FASTBERT_F32;
  if (t.scalar_type() == at::kHalf) return FASTBERT_F16;
  if (t.scalar_type() == at::kBFloat16) return FASTBERT_BF16;
  TORCH_CHECK_TYPE(false, "native CUDA kernels take float32, float16 or bfloat16, got ", what, " of ", t.scalar_type());
}

void check_launch(int code, const char* op, int64_t n) {
  TORCH_CHECK_VALUE(code != FASTBERT_CUDA_UNSUPPORTED, op, ": rows of ", n, " elements are longer than the ",
                    FASTBERT_CUDA_MAX_ROW, " the CUDA kernels keep in registers");
  TORCH_CHECK(code == 0, op, ": CUDA launch failed: ", cudaGetErrorString(cudaError_t(code)));
}

void* stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

at::Tensor embedding_layernorm(const std::optional<at::Tensor>& input_ids, const at::Tensor& token_type_ids,
                               const at::Tensor& position_ids, const at::Tensor& word_weight,
                               const at::Tensor& position_weight, const at::Tensor& type_weight,
                               const at::Tensor& ln_weight, const at::Tensor& ln_bias, double eps,
                               const std::optional<at::Tensor>& inputs_embeds,
                               const std::optional<at::Tensor>& out_opt) {
  TORCH_CHECK_VALUE(input_ids.has_value() != inputs_embeds.has_value(), "pass exactly one of input_ids, inputs_embeds");
  const at::Tensor& lead = inputs_embeds ? *inputs_embeds : word_weight;
  const int dtype = dtype_code(lead, inputs_embeds ? "inputs_embeds" : "word_weight");
  const c10::cuda::CUDAGuard guard(lead.device());
  const int64_t dim = lead.size(-1);
  std::vector<int64_t> shape = inputs_embeds ? inputs_embeds->sizes().vec() : input_ids->sizes().vec();
  if (!inputs_embeds) shape.push_back(dim);
  const int64_t tokens = inputs_embeds ? inputs_embeds->numel() / std::max<int64_t>(dim, 1) : input_ids->numel();
  TORCH_CHECK_VALUE(token_type_ids.numel() == tokens && position_ids.numel() == tokens,
                    "token_type_ids and position_ids must have one entry per token (", tokens, ")");
  const at::ScalarType itype = index_type({input_ids ? &*input_ids : nullptr, &token_type_ids, &position_ids});
  auto ids_of = [&](const at::Tensor& ids, const char* what) {
    check_device(ids, lead.device(), what);
    return ids.reshape({-1}).to(itype).contiguous();  // range checked in the kernel: no host sync
  };
  at::Tensor words = inputs_embeds ? as_rows(*inputs_embeds, dim) : at::Tensor();
  at::Tensor ww = inputs_embeds ? at::Tensor() : table(word_weight, lead, dim, "word_weight");
  at::Tensor ids = inputs_embeds ? at::Tensor() : ids_of(*input_ids, "input_ids");
  at::Tensor tw = table(type_weight, lead, dim, "type_weight"), pw = table(position_weight, lead, dim, "pos_weight");
  at::Tensor tts = ids_of(token_type_ids, "token_type_ids"), pos = ids_of(position_ids, "position_ids");
  at::Tensor w = params(ln_weight, dim, lead.device(), "ln_weight");
  at::Tensor b = params(ln_bias, dim, lead.device(), "ln_bias");
  at::Tensor out = output(out_opt, shape, lead);
  const int code = fastbert_cuda_embedding_layernorm(
      dtype, itype == at::kLong, words.defined() ? words.data_ptr() : nullptr, words.defined() ? words.stride(0) : 0,
      ids.defined() ? ids.data_ptr() : nullptr, tts.data_ptr(), pos.data_ptr(), ww.defined() ? ww.data_ptr() : nullptr,
      ww.defined() ? ww.stride(0) : 0, ww.defined() ? ww.size(0) : 1, tw.data_ptr(), tw.stride(0), tw.size(0),
      pw.data_ptr(), pw.stride(0), pw.size(0),
      w.data_ptr<float>(), b.data_ptr<float>(), float(eps), out.data_ptr(), tokens, dim, stream());
  check_launch(code, "embedding_layernorm", dim);
  return out;
}

at::Tensor bias_act(const at::Tensor& x, const at::Tensor& bias, const std::string& kind,
                    const std::optional<at::Tensor>& out_opt) {
  const int dtype = dtype_code(x, "x");
  const int act = act_code(kind);
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must be [*, N], got a scalar");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(-1);
  at::Tensor b = params(bias, n, x.device(), "bias");
  at::Tensor out = output(out_opt, x.sizes(), x);
  at::Tensor rows = as_rows(x, n);
  const int code = fastbert_cuda_bias_act(dtype, act, rows.data_ptr(), rows.stride(0), b.data_ptr<float>(),
                                          out.data_ptr(), rows.size(0), n, stream());
  check_launch(code, "bias_act", n);
  return out;
}

at::Tensor bias_residual_layernorm(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                                   const at::Tensor& ln_weight, const at::Tensor& ln_bias, double eps,
                                   const std::optional<at::Tensor>& out_opt) {
  const int dtype = dtype_code(x, "x");
  check_device(residual, x.device(), "residual");
  TORCH_CHECK_TYPE(residual.scalar_type() == x.scalar_type(), "residual must be ", x.scalar_type(), ", got ",
                   residual.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && residual.sizes() == x.sizes(), "x and residual must have the same shape, got ",
                    x.sizes(), " and ", residual.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(-1);
  at::Tensor b = params(bias, n, x.device(), "bias"), w = params(ln_weight, n, x.device(), "ln_weight");
  at::Tensor lb = params(ln_bias, n, x.device(), "ln_bias");
  at::Tensor out = output(out_opt, x.sizes(), x);
  at::Tensor xr = as_rows(x, n), rr = as_rows(residual, n);
  const int code = fastbert_cuda_bias_residual_layernorm(dtype, xr.data_ptr(), xr.stride(0), b.data_ptr<float>(),
                                                         rr.data_ptr(), rr.stride(0), w.data_ptr<float>(),
                                                         lb.data_ptr<float>(), float(eps), out.data_ptr(), xr.size(0),
                                                         n, stream());
  check_launch(code, "bias_residual_layernorm", n);
  return out;
}

}  // namespace
}  // namespace fastbert::cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("MAX_ROW") = FASTBERT_CUDA_MAX_ROW;  // the limit, defined once (launch.h), read by the dispatch
  using namespace fastbert::cuda;
  m.doc() = "fastbert native CUDA kernels (16-byte accesses, fp32 statistics)";
  m.def("embedding_layernorm", &embedding_layernorm, "LayerNorm(word[ids] + pos[pos] + type[tt]) -> [*, E]",
        py::arg("input_ids"), py::arg("token_type_ids"), py::arg("position_ids"), py::arg("word_weight"),
        py::arg("position_weight"), py::arg("type_weight"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"),
        py::arg("inputs_embeds"), py::arg("out") = py::none());
  m.def("bias_act", &bias_act, "act(x + bias)", py::arg("x"), py::arg("bias"), py::arg("kind"),
        py::arg("out") = py::none());
  m.def("bias_residual_layernorm", &bias_residual_layernorm, "LayerNorm(x + bias + residual)", py::arg("x"),
        py::arg("bias"), py::arg("residual"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"),
        py::arg("out") = py::none());
}
