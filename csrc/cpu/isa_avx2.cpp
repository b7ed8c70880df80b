// CPU kernels compiled for AVX2 + FMA; bind.cpp uses this table when the CPU has it.
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
#pragma GCC target("avx2,fma")
#define FASTBERT_ISA avx2
#define FASTBERT_VEC_BITS 256  // linear.inc's vectors (0: scalar)
#include "isa_body.inc"
#endif
