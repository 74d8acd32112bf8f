/* The lane helpers of the ARM NEON build (cpu_kernels_neon.c, cpu_attention_neon.c): what
 * cpu_kernels_vector.h's AVX2 helpers and cpu_kernels_scalar.h's plain C do, operation for
 * operation, on 128-bit vectors, so that the NEON build's numbers equal the scalar build's
 * (and so AVX2's) bit for bit. AVX2's eight float lanes are two NEON vectors here: `lo` holds
 * lanes 0..3, `hi` lanes 4..7. Where a NEON instruction's result differs from the x86 one for
 * some input (vmaxq on a NaN, vcvtnq out of range), the helper follows x86.
 *
 * Only the NEON build includes this (and <arm_neon.h>); it compiles for any AArch64 CPU, with
 * the dot-product instruction where the compiler is told the CPU has it
 * (__ARM_FEATURE_DOTPROD: native.py adds +dotprod where the CPU reports it), else with
 * widening multiplies that give the same exact integer sums.
 */
#ifndef SPECDRAFT_CPU_KERNELS_NEON_H
#define SPECDRAFT_CPU_KERNELS_NEON_H

#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels_shared.h"

#define NEON_ROWS 4 /* rows one call of a block product takes at once (speed only, as ROWS) */

/* maxps lane by lane: a where a > b, else b (equal values, a NaN: b); vmaxq would give NaN. */
static inline __attribute__((always_inline)) float32x4_t lane_max4(float32x4_t a, float32x4_t b) {
    return vbslq_f32(vcgtq_f32(a, b), a, b);
}

/* hsum's order over eight lanes: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)). */
static inline __attribute__((always_inline)) float sum8(float32x4_t lo, float32x4_t hi) {
    const float32x4_t t = vaddq_f32(lo, hi);                         /* v0+v4, v1+v5, v2+v6, v3+v7 */
    const float32x2_t u = vadd_f32(vget_low_f32(t), vget_high_f32(t)); /* t0+t2, t1+t3 */
    return vget_lane_f32(u, 0) + vget_lane_f32(u, 1);
}

/* hmax's order, the same tree of maxps. */
static inline __attribute__((always_inline)) float max8(float32x4_t lo, float32x4_t hi) {
    const float32x4_t m = lane_max4(lo, hi);
    const float32x4_t n = lane_max4(m, vextq_f32(m, m, 2)); /* lanes 0, 1: max(m0, m2), max(m1, m3) */
    const float a = vgetq_lane_f32(n, 0), b = vgetq_lane_f32(n, 1);
    return a > b ? a : b;
}

/* cvtps2dq: to the nearest integer, ties to even; a NaN or a value outside int32's range
 * gives INT32_MIN (vcvtnq would saturate, and give 0 for a NaN). */
static inline __attribute__((always_inline)) int32x4_t to_int4(float32x4_t v) {
    const uint32x4_t inside = vandq_u32(vcgeq_f32(v, vdupq_n_f32(-2147483648.0f)),
                                        vcltq_f32(v, vdupq_n_f32(2147483648.0f)));
    return vbslq_s32(inside, vcvtnq_s32_f32(v), vdupq_n_s32(INT32_MIN));
}

/* exp(x) for x <= 0, Cephes' polynomial step for step (cpu_kernels_vector.h's exp_nonpositive:
 * separate multiplies and subtractions where it has them, a fused multiply-add where it does). */
static inline __attribute__((always_inline)) float32x4_t exp_nonpositive4(float32x4_t x) {
    x = lane_max4(x, vdupq_n_f32(-87.0f));
    const float32x4_t fx = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    x = vsubq_f32(x, vmulq_f32(fx, vdupq_n_f32(0.693359375f)));
    x = vsubq_f32(x, vmulq_f32(fx, vdupq_n_f32(-2.12194440e-4f)));
    float32x4_t y = vdupq_n_f32(1.9875691500e-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, x);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, x);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, x);
    y = vfmaq_f32(vaddq_f32(x, vdupq_n_f32(1.0f)), y, vmulq_f32(x, x));
    const int32x4_t power = vshlq_n_s32(vaddq_s32(to_int4(fx), vdupq_n_s32(127)), 23);
    return vmulq_f32(y, vreinterpretq_f32_s32(power));
}

/* acc + for each lane (column) l the sum of the four products w[4l + t] x q[4l + t]: the
 * dot-product instruction where the build has it, else widening multiplies and pairwise sums
 * (the same exact integers: no product or pair overflows int16). */
static inline __attribute__((always_inline)) int32x4_t dot4(int32x4_t acc, int8x16_t w, int8x16_t q) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, w, q);
#else
    const int32x4_t low = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(q)));
    const int32x4_t high = vpaddlq_s16(vmull_high_s8(w, q));
    return vaddq_s32(acc, vpaddq_s32(low, high));
#endif
}

/* Four activation bytes q[0..3] in every lane (what each column's four codes meet). */
static inline __attribute__((always_inline)) int8x16_t broadcast4(const int8_t *q) {
    return vreinterpretq_s8_s32(vdupq_n_s32(four_bytes(q)));
}

/* Sixteen float16 values widened exactly (the F16 conversion every AArch64 CPU has). */
static inline __attribute__((always_inline)) void widen16(const uint16_t *h, float32x4_t *out) {
    for (int k = 0; k < 4; k++) out[k] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + 4 * k)));
}

#endif
