/* Causal attention on ARM NEON (the NEON build; cpu_attention_scalar.c is the plain C one),
 * bit for bit what the scalar build computes, row by row and head by head: a key's score in
 * 8 lanes (two vectors; the first product a multiply, the rest fused multiply-adds), the lanes
 * added in the scalar build's tree, times the scale; keys in blocks of 8, the last block's
 * missing keys -inf; the maximum per lane (maxps) and across lanes in hmax's tree; each weight
 * exp_nonpositive(score - max), summed per lane in key order and across lanes in hsum's tree;
 * the values summed per dimension in key order, one fused multiply-add per key, then times
 * 1 / the sum.
 */
#include <arm_neon.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_neon.h"

/* The scaled score of query q against key k (D a multiple of 8):
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline __attribute__((always_inline)) float score(const float *q, const float *k, int D, float scale) {
    float32x4_t lo = vmulq_f32(vld1q_f32(q), vld1q_f32(k)), hi = vmulq_f32(vld1q_f32(q + 4), vld1q_f32(k + 4));
    for (int d = HEAD_LANES; d < D; d += HEAD_LANES) {
        lo = vfmaq_f32(lo, vld1q_f32(q + d), vld1q_f32(k + d));
        hi = vfmaq_f32(hi, vld1q_f32(q + d + 4), vld1q_f32(k + d + 4));
    }
    const float32x4_t pairs = vpaddq_f32(lo, hi);      /* l0+l1, l2+l3, l4+l5, l6+l7 */
    const float32x4_t quads = vpaddq_f32(pairs, pairs); /* (l0+l1)+(l2+l3), (l4+l5)+(l6+l7), .. */
    return (vgetq_lane_f32(quads, 0) + vgetq_lane_f32(quads, 1)) * scale;
}

/* One row of one head (AttendRow, cpu_kernels_shared.h). */
static void attend_row(const float *q, const float *kh, const float *vh, const int *slots, int length, int D,
                       float scale, float *weights, float *out) {
    const int padded = (length + 7) / 8 * 8;
    float32x4_t best_lo = vdupq_n_f32(-INFINITY), best_hi = best_lo;
    for (int j = 0; j < padded; j++)
        weights[j] = j < length ? score(q, kh + (size_t)(slots ? slots[j] : j) * D, D, scale) : -INFINITY;
    for (int j = 0; j < padded; j += 8) {
        best_lo = lane_max4(best_lo, vld1q_f32(weights + j));
        best_hi = lane_max4(best_hi, vld1q_f32(weights + j + 4));
    }
    const float32x4_t top = vdupq_n_f32(max8(best_lo, best_hi));
    float32x4_t total_lo = vdupq_n_f32(0.0f), total_hi = total_lo;
    for (int j = 0; j < padded; j += 8) {
        const float32x4_t lo = exp_nonpositive4(vsubq_f32(vld1q_f32(weights + j), top));
        const float32x4_t hi = exp_nonpositive4(vsubq_f32(vld1q_f32(weights + j + 4), top));
        vst1q_f32(weights + j, lo);
        vst1q_f32(weights + j + 4, hi);
        total_lo = vaddq_f32(total_lo, lo);
        total_hi = vaddq_f32(total_hi, hi);
    }
    const float inverse = 1.0f / sum8(total_lo, total_hi);
    float32x4_t sums[MAX_HEAD_DIM / 4];
    for (int d = 0; d < D / 4; d++) sums[d] = vdupq_n_f32(0.0f);
    for (int j = 0; j < length; j++) {
        const float *vj = vh + (size_t)(slots ? slots[j] : j) * D;
        const float32x4_t w = vdupq_n_f32(weights[j]);
        for (int d = 0; d < D / 4; d++) sums[d] = vfmaq_f32(sums[d], w, vld1q_f32(vj + 4 * d));
    }
    for (int d = 0; d < D / 4; d++) vst1q_f32(out + 4 * d, vmulq_n_f32(sums[d], inverse));
}

/* cpu_attention.c's causal_attention_impl, the same arguments (D at most MAX_HEAD_DIM). */
int causal_attention_impl(const float *q, const float *keys, const float *values, int n, int start, int H, int KVH,
                          int D, int capacity, float scale, const int *parents, int window, float *out, int threads) {
    return attention_by_rows(attend_row, q, keys, values, n, start, H, KVH, D, capacity, scale, parents, window, out,
                             threads);
}
