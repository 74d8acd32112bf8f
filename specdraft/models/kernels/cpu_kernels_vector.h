/* The vector helpers of the AVX2 and AVX-512 VNNI builds (cpu_kernels.c, cpu_kernels_six.c,
 * cpu_kernels_vnni.c, cpu_attention.c): the weight prefetch, horizontal sums and maxima, and
 * exp for non-positive arguments. cpu_kernels_scalar.c and cpu_attention_scalar.c follow each of
 * them step for step in plain C (the same lanes, the same order of operations), so the scalar
 * build gives their numbers bit for bit. Only the vector builds include this (and
 * <immintrin.h>): the scalar build compiles on any CPU.
 */
#ifndef SPECDRAFT_CPU_KERNELS_VECTOR_H
#define SPECDRAFT_CPU_KERNELS_VECTOR_H

#include <immintrin.h>

#include "cpu_kernels_shared.h"

/* A weight's codes stream through once per forward, far more bytes than the caches hold and
 * none of them read again soon, so each group of a 4-bit product asks for the group
 * PREFETCH_AHEAD bytes further on (in the same stream: a thread walks its blocks in order), so
 * that it arrives in time for the multiply. An ordinary prefetch (T0), not a non-temporal one:
 * the non-temporal hint was a little faster on one AMD EPYC, but made the 4-bit products
 * several times slower on an Intel Xeon, where the lines it brought were gone before the
 * multiply (docs/history/2026-12-07-gemma3-on-the-kernels.md). The 8-bit products do not
 * prefetch: with the same prefetch, whole runs whose output head is 8-bit were slower than
 * without it. Prefetching never faults, so reading past a weight's end is harmless. Both
 * macros may be set with -D to try other values. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2048
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif

static inline __attribute__((always_inline)) void prefetch_codes(const void *group, int lines) {
    for (int k = 0; k < lines; k++) _mm_prefetch((const char *)group + PREFETCH_AHEAD + 64 * k, PREFETCH_HINT);
}

/* The horizontal sum of a vector (attention's normalizer, RMSNorm's sum of squares):
 * ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)). */
static inline __attribute__((always_inline)) float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* The same order for the maximum (maxps: a > b ? a : b, else b). */
static inline __attribute__((always_inline)) float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* exp(x) for x <= 0 (Cephes' single-precision polynomial): the same operations for every
 * lane, so a score's weight never depends on its neighbours. */
static inline __attribute__((always_inline)) __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(power));
}

#endif
