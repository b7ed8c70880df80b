// CPU kernels compiled for the avx512bf16 set plus AMX tiles (Sapphire Rapids, Emerald Rapids, Granite Rapids): the
// int8 quad GEMM runs on tdpbusd where K is whole tiles (amx_linear.inc), the bf16 GEMM on tdpbf16ps
// (amx_bf16_linear.inc), fp32 as three bf16 parts on the same tiles (amx_bf16x3_linear.inc), bf16 attention and an
// int8 model's fp32 attention on tdpbf16ps where the head dim allows (attention.inc), everything else as in
// avx512bf16. bind.cpp prefers this table when the CPU has AMX-TILE, AMX-INT8
// and AMX-BF16 and the kernel grants this process the tile state.
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
#pragma GCC target( \
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,amx-tile,amx-int8,amx-bf16,avx2,fma," \
    "prefer-vector-width=512")
#define FASTBERT_ISA avx512amx
#define FASTBERT_VEC_BITS 512  // linear.inc's vectors (0: scalar)
#define FASTBERT_VNNI 1        // linear.inc: vpdpwssd, multiply-add-accumulate in one instruction
#define FASTBERT_BF16_PAIRS 1  // attention.inc: bf16 attention on vdpbf16ps
#define FASTBERT_AMX 1         // the int8 quad GEMM (tdpbusd), the bf16 GEMM and bf16 attention (tdpbf16ps) on tiles
#include "isa_body.inc"
#endif
