// CPU kernels compiled for the compiler's baseline ISA (SSE2 on x86-64; NEON etc. elsewhere): bind.cpp's fallback.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels.h"

#define FASTBERT_ISA generic
#define FASTBERT_VEC_BITS 0  // linear.inc's vectors (0: scalar)
#include "isa_body.inc"
