// Which vector instructions the kernels are built for (build.py compiles with -march=native):
//   STRATA_AVX512  AVX-512 F and BW: 16 float32 lanes, masked loads and stores;
//   STRATA_AVX2    else AVX2 with FMA and F16C (Zen 3, Intel Haswell to Comet Lake): 8 lanes, so each
//                  16-lane step of the AVX-512 code runs as two, with its own register blocking (16
//                  registers where AVX-512 has 32);
//   neither        plain loops, left to the compiler.
// linear_panels.h keys its AVX-512 panels on __AVX512F__ alone and its AMX tiles on AMX's own flags.

#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define STRATA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STRATA_AVX2 1
#endif
