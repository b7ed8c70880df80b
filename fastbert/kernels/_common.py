"""Launch rules and helpers shared by the kernel files: block sizes from the feature dim, warps from the tile.

The rules are deliberately small so a launch can be read off the shape: a row kernel holds a whole feature row
(next power of two, masked), packs rows until the tile reaches `TILE_ELEMS`, and gives one warp per
`ELEMS_PER_WARP` tile elements. Reductions over rows (bias / LayerNorm weight grads) run on a fixed number of
persistent programs that each write one fp32 partial row, summed afterwards: deterministic, no atomics.
"""

from __future__ import annotations

import torch

TILE_ELEMS = 4096  # elements per program tile in the row kernels
ELEMS_PER_WARP = 512  # 16 fp32 per thread
MAX_WARPS = 8


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), in plain Python: a launch's host path calls it (triton's own
    version goes through its constexpr wrapper, three calls a time)."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids, in plain Python (see next_power_of_2)."""
    return -(-a // b)


def apply(function: type[torch.autograd.Function], *args: object) -> object:
    """`function.apply(*args)` without the Python wrapper's per-argument work (functorch's unwrapping of dead
    wrappers, ~10 calls a launch), which only matters under functorch transforms: those take the full path."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)


def feature_block(n: int) -> int:
    """Block over the feature dim: the next power of two (at least 16, the smallest tl.dot / vector width)."""
    return max(16, next_power_of_2(n))


def rows_per_program(block_n: int) -> int:
    """Rows a row kernel handles at once so the tile holds about TILE_ELEMS elements."""
    return max(1, TILE_ELEMS // block_n)


def warps_for(tile_elems: int) -> int:
    """num_warps for a tile: one warp per ELEMS_PER_WARP elements, between 1 and MAX_WARPS (a power of two)."""
    return min(MAX_WARPS, next_power_of_2(max(1, tile_elems // ELEMS_PER_WARP)))


def reduction_programs(row_blocks: int, device: torch.device) -> int:
    """Persistent programs for a kernel that also reduces over rows: about two per SM, never more than blocks."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(row_blocks, 2 * sms))
    return max(1, min(row_blocks, 4))  # the interpreter: few programs, each looping over its rows


def dropout_seed() -> int:
    """A Philox seed drawn from torch's CPU generator: follows torch.manual_seed, and never syncs the device."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def keep_scale(p: float) -> float:
    """The factor kept elements are multiplied by (inverted dropout); 0 when everything is dropped."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """[*, n] -> [M, n] with a unit feature stride (a view where possible, a copy otherwise)."""
    rows = x.reshape(-1, n)
    return rows if rows.stride(-1) == 1 or n == 1 else rows.contiguous()


def interpreter_bf16(t: torch.Tensor) -> bool:
    """bf16 on the CPU interpreter: tl.dot operands must go in as fp32 there (see _device.dot)."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


def check_dropout(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")


class Saved:
    """Stands in for an autograd ctx where a Function's forward or backward runs inside a torch custom op (the path
    torch.compile traces): the custom op's own autograd registration saves and hands over the tensors."""

    saved_tensors: tuple = ()

    def __init__(self, saved: tuple = (), **attrs: object) -> None:
        self.saved_tensors = saved
        self.__dict__.update(attrs)

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        self.saved_tensors = tensors


def seed_tensor(seed: int) -> torch.Tensor:
    """A dropout seed as a custom op's output (ops return tensors): one int64 on the CPU, read without a device sync."""
    return torch.tensor([seed], dtype=torch.int64)
