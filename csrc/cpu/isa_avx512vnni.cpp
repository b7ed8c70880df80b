// CPU kernels compiled for AVX-512 plus AVX512-VNNI without AVX512-BF16 (Cascade Lake, Ice Lake and other Intel
// server cores of 2019-2022, most cloud x86 instances of that age): the avx512 set with the int8 GEMMs on VNNI (u8 x s8
// quads on vpdpbusd, int16 pairs on vpdpwssd). bind.cpp prefers it to avx512 when the CPU has VNNI.
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
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,prefer-vector-width=512")
#define FASTBERT_ISA avx512vnni
#define FASTBERT_VEC_BITS 512  // linear.inc's vectors (0: scalar)
#define FASTBERT_VNNI 1        // linear.inc: vpdpbusd / vpdpwssd, multiply-add-accumulate in one instruction
#include "isa_body.inc"
#endif
