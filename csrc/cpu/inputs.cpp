// See inputs.h. Scalar loops: the tensors are a batch's ids and mask, a few thousand elements, read once.
#include "inputs.h"

#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace fastbert::cpu {
namespace {

// Every mask dtype fastbert.validation accepts: bool, the integer types, float32/64, float16, bfloat16.
#define FASTBERT_DISPATCH_MASK(TYPE, NAME, ...) \
  AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

}  // namespace

void min_max(const at::Tensor& ids, int64_t* out) {
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
                   "ids must be int64 or int32, got ", ids.scalar_type());
  TORCH_CHECK_VALUE(ids.numel() > 0, "ids must not be empty");
  const at::Tensor flat = ids.contiguous();
  AT_DISPATCH_INDEX_TYPES(flat.scalar_type(), "input_ranges", [&] {
    const index_t* p = flat.const_data_ptr<index_t>();
    index_t lo = p[0], hi = p[0];
    for (int64_t i = 1; i < flat.numel(); ++i) {
      lo = std::min(lo, p[i]);
      hi = std::max(hi, p[i]);
    }
    out[0] = lo;
    out[1] = hi;
  });
}

namespace {

// Whether any value is neither 0 nor 1 (NaN is neither, as torch's `(m != 0) & (m != 1)` finds).
bool not_binary(const at::Tensor& mask) {
  const at::Tensor flat = mask.contiguous();
  bool bad = false;
  FASTBERT_DISPATCH_MASK(flat.scalar_type(), "input_ranges", [&] {
    const scalar_t* p = flat.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < flat.numel() && !bad; ++i) {
      bad = p[i] != scalar_t(0) && p[i] != scalar_t(1);
    }
  });
  return bad;
}

// Whether pad_id is in the first or last column of [B, S] ids.
bool pad_at_ends(const at::Tensor& ids, int64_t pad_id) {
  TORCH_CHECK_VALUE(ids.dim() == 2 && ids.numel() > 0, "input_ranges: pad_ends must be a non-empty [B, S] tensor");
  const at::Tensor a = ids.contiguous();
  const int64_t rows = a.size(0), cols = a.size(1);
  bool seen = false;
  AT_DISPATCH_INDEX_TYPES(a.scalar_type(), "input_ranges", [&] {
    const index_t* p = a.const_data_ptr<index_t>();
    for (int64_t r = 0; r < rows && !seen; ++r) seen = p[r * cols] == pad_id || p[r * cols + cols - 1] == pad_id;
  });
  return seen;
}

}  // namespace

at::Tensor input_ranges(const std::vector<at::Tensor>& ids, const std::optional<at::Tensor>& mask,
                        const std::optional<at::Tensor>& pad_ends, int64_t pad_id) {
  const int64_t n = 2 * int64_t(ids.size()) + mask.has_value() + pad_ends.has_value();
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  int64_t* v = out.data_ptr<int64_t>();
  for (const at::Tensor& t : ids) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), "input_ranges takes CPU tensors");
    min_max(t, v);
    v += 2;
  }
  TORCH_CHECK_VALUE((!mask || mask->device().is_cpu()) && (!pad_ends || pad_ends->device().is_cpu()),
                    "input_ranges takes CPU tensors");
  if (mask) *v++ = not_binary(*mask);
  if (pad_ends) *v++ = pad_at_ends(*pad_ends, pad_id);
  return out;
}

std::tuple<int64_t, int64_t, at::Tensor, std::optional<at::Tensor>> mask_packing(const at::Tensor& mask) {
  TORCH_CHECK_VALUE(mask.dim() == 2 && mask.device().is_cpu(), "mask_packing takes a [B, S] CPU mask, got ",
                    mask.sizes());
  const at::Tensor m = mask.contiguous();
  const int64_t rows = m.size(0), cols = m.size(1);
  at::Tensor cu = at::empty({rows + 1}, at::TensorOptions().dtype(at::kInt));
  int32_t* c = cu.data_ptr<int32_t>();
  int64_t longest = 0, total = 0;
  c[0] = 0;
  FASTBERT_DISPATCH_MASK(m.scalar_type(), "mask_packing", [&] {
    const scalar_t* p = m.const_data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      int64_t count = 0;
      for (int64_t s = 0; s < cols; ++s) count += p[r * cols + s] != scalar_t(0);
      longest = std::max(longest, count);
      total += count;
      c[r + 1] = int32_t(total);
    }
  });
  if (total == rows * cols) return {longest, total, cu, std::nullopt};
  at::Tensor indices = at::empty({total}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = indices.data_ptr<int64_t>();
  FASTBERT_DISPATCH_MASK(m.scalar_type(), "mask_packing", [&] {
    const scalar_t* p = m.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < rows * cols; ++i)
      if (p[i] != scalar_t(0)) *out++ = i;
  });
  return {longest, total, cu, indices};
}

}  // namespace fastbert::cpu
