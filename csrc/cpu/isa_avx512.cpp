// CPU kernels compiled for AVX-512 (F/BW/VL/DQ) with 512-bit vectors; bind.cpp uses this table when the CPU has it.
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
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")
#define FASTBERT_ISA avx512
#define FASTBERT_VEC_BITS 512  // linear.inc's vectors (0: scalar)
#include "isa_body.inc"
#endif
