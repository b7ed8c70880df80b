// CPU kernels compiled for AVX-512 plus AVX512-BF16 and AVX512-VNNI (Zen 4, Cooper Lake, Sapphire Rapids and later):
// the avx512 set, with int8 GEMM tiles on vpdpwssd and bf16 attention doing its two matrix products as bf16 pair dot
// products (attention.inc). bind.cpp prefers this table when the CPU has the instructions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,prefer-vector-width=512")
#define FASTBERT_ISA avx512bf16
#define FASTBERT_VEC_BITS 512  // linear.inc's vectors (0: scalar)
#define FASTBERT_VNNI 1        // linear.inc: vpdpwssd, multiply-add-accumulate in one instruction
#define FASTBERT_BF16_PAIRS 1  // attention.inc: bf16 attention on vdpbf16ps (GCC defines no ISA macro for a target pragma)
#include "isa_body.inc"
#endif
