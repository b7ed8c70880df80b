"""Row buckets: the loop's token count rounded up where the GEMM library compiles a kernel per row count.

Unpadded execution gives nearly every batch a token count of its own, and oneDNN compiles a GEMM kernel per shape: on
a CPU with AMX a bf16 GEMM at a new row count took 10-20x the GEMM itself (`capabilities.new_row_count_cost`), so a
stream of batches recompiled every GEMM of every forward. Where that cost is measured, CPU inference lays the packed
tokens into a bucket: the count rounded up to one of eight steps per octave (multiples of 16; at most 12.5% more rows,
about 6% on average), the rows past the call's tokens filler sequences of zeros no longer than its longest sequence,
dropped after the last layer. Every kernel sees a valid varlen batch, each real token's output is the same (rows meet
only in attention, which stays inside each sequence), and a model compiles a few dozen GEMM kernels in all.
`FASTBERT_ROW_BUCKETS=1` buckets wherever the loop runs inference, `=0` never.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from fastbert import capabilities
from fastbert.backends import onednn
from fastbert.padding import Packing

ENV = "FASTBERT_ROW_BUCKETS"
OWN_GEMMS = frozenset({"gemm", "int8"})  # fastbert's GEMM backends: kernels built once, for any row count


def bucket(total: int) -> int:
    """The bucket of `total` rows: `total` rounded up to eight steps per octave, multiples of 16 (0 stays 0)."""
    step = max(16, 1 << max(0, total.bit_length() - 4))
    return -(-total // step) * step


def decide(plan: object) -> tuple[bool, str]:
    """Whether the loop lays `plan`'s forwards into row buckets, and why; decided at its first forward (the probe
    times GEMMs) and kept on the plan for explain()."""
    decided = getattr(plan, "row_buckets", None)
    if decided is None:
        decided = plan.row_buckets = _decide(plan.mode, plan.ran)
    return decided


def _decide(mode: object, ran: dict[str, frozenset[str]]) -> tuple[bool, str]:
    """The decision for a plan's mode, given the backends each op took in its first forward."""
    forced = os.environ.get(ENV, "").strip()
    if forced == "0":
        return False, f"{ENV}=0"
    if mode.device.type != "cpu":
        return False, "CPU only (CUDA graphs lay calls into buckets of their own)"
    if mode.grad or mode.training:
        return False, "inference only: a training forward keeps its rows (dropout draws per row)"
    if forced == "1":
        return True, f"{ENV}=1"
    gemms = ran.get("linear", frozenset()) | ran.get("dense_residual_layernorm", frozenset())
    if gemms and gemms <= OWN_GEMMS:
        return False, (f"the first forward's GEMMs ran on {' and '.join(sorted(gemms))}, which compile nothing per row "
                       "count")
    dtype = mode.autocast or mode.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"no {str(dtype).removeprefix('torch.')} GEMM is compiled per row count here"
    cost = capabilities.new_row_count_cost(onednn.gemm_dtype(dtype))
    if cost.ok:
        return True, f"{cost.why}: row counts rounded up to eight steps per octave"
    return False, f"{cost.why}: row counts as they come"


def lay(plan: object, x: torch.Tensor, packing: Packing) -> tuple[torch.Tensor, Packing]:
    """x [T, H] and its packing, laid into T's bucket where `plan` buckets rows: zero rows appended, covered by filler
    sequences of at most max_seqlen tokens (the relative-position tables stay the call's); else both as given."""
    total = x.shape[0]
    rows = bucket(total)
    if rows == total or not decide(plan)[0]:
        return x, packing
    seqlen = max(packing.max_seqlen, 1)
    fillers = math.ceil((rows - total) / seqlen)
    ends = (torch.arange(1, fillers + 1, dtype=torch.int32) * seqlen + total).clamp_(max=rows)  # [fillers]
    cu = torch.cat([packing.cu_seqlens, ends.to(packing.cu_seqlens.device)])
    laid = Packing(packing.batch + fillers, seqlen, cu, packing.max_seqlen, torch.arange(rows, device=x.device))
    return F.pad(x, (0, 0, 0, rows - total)), laid


def cut(x: torch.Tensor, total: int, hidden: list[torch.Tensor] | None) -> torch.Tensor:
    """The first `total` rows of the encoder's output and of each hidden state kept (views: no copy)."""
    if x.shape[0] == total:
        return x
    if hidden is not None:
        hidden[:] = [h[:total] for h in hidden]
    return x[:total]
