// A CPU forward's reads of its inputs, each one pass over the tensors in place of a chain of small ATen ops (each op
// costs a few microseconds inside a forward, more than the read itself): the range checks' values
// (fastbert/validation.py) and the packing of a padded batch (fastbert/padding.py), with the same results.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace fastbert::cpu {

// out[0], out[1] = min and max of a non-empty id tensor (int64 or int32, any layout).
void min_max(const at::Tensor& ids, int64_t* out);

// [2 * ids.size() + flags] int64: (min, max) of each id tensor (int64 or int32, at least one element), then 1/0 for a
// mask holding a value other than 0 and 1 (when `mask` is given), then 1/0 for pad_id in the first or last column of
// `pad_ends` ([B, S] input_ids, when given).
at::Tensor input_ranges(const std::vector<at::Tensor>& ids, const std::optional<at::Tensor>& mask,
                        const std::optional<at::Tensor>& pad_ends, int64_t pad_id);

// A [B, S] mask's packing, nonzero = a real token: (longest row, total, cu_seqlens [B + 1] int32, the flat positions
// of the real tokens [total] int64, or None when every position is real).
std::tuple<int64_t, int64_t, at::Tensor, std::optional<at::Tensor>> mask_packing(const at::Tensor& mask);

}  // namespace fastbert::cpu
