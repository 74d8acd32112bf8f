/* Causal attention in plain C (the scalar build; cpu_attention.c is the AVX2 one), bit for bit
 * what the AVX2 code computes, row by row and head by head (the AVX2 code's tiles change which
 * row waits for which key, never a row's own operations):
 *
 * - a key's score: its dot product with the query in 8 lanes (lane l sums dimensions l, l + 8,
 *   ..., the first a product, the rest fused multiply-adds), the lanes added as the hadd tree
 *   of scores8 adds them, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), times the scale;
 * - keys in blocks of 8, the last block's missing keys -inf; the maximum per lane over the
 *   blocks (maxps), then across the lanes in hmax's tree;
 * - each score's weight exp_nonpositive(score - max), the padded lanes' included (-inf - max
 *   clamps at -87: a weight of about 1.6e-38, as the vector code adds it), summed per lane in
 *   key order and across the lanes in hsum's tree;
 * - the values summed per dimension in key order, one fused multiply-add per key (the first
 *   onto 0), then times 1 / the sum.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_scalar.h"

/* The scaled score of query q against key k (D a multiple of 8). */
static float score(const float *q, const float *k, int D, float scale) {
    float l[HEAD_LANES];
    for (int u = 0; u < HEAD_LANES; u++) l[u] = q[u] * k[u];
    for (int d = HEAD_LANES; d < D; d += HEAD_LANES)
        for (int u = 0; u < HEAD_LANES; u++) l[u] = fmaf(q[d + u], k[d + u], l[u]);
    return (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) * scale;
}

/* One row of one head (AttendRow, cpu_kernels_shared.h). */
static void attend_row(const float *q, const float *kh, const float *vh, const int *slots, int length, int D,
                       float scale, float *weights, float *out) {
    const int padded = (length + 7) / 8 * 8;
    float best[8], total[8] = {0};
    for (int u = 0; u < 8; u++) best[u] = -INFINITY;
    for (int j = 0; j < padded; j++) {
        weights[j] = j < length ? score(q, kh + (size_t)(slots ? slots[j] : j) * D, D, scale) : -INFINITY;
        best[j % 8] = lane_max(best[j % 8], weights[j]);
    }
    const float top = max8(best);
    for (int j = 0; j < padded; j++) {
        weights[j] = exp_nonpositive(weights[j] - top);
        total[j % 8] += weights[j];
    }
    const float inverse = 1.0f / sum8(total);
    float sums[MAX_HEAD_DIM] = {0};
    for (int j = 0; j < length; j++) {
        const float *vj = vh + (size_t)(slots ? slots[j] : j) * D;
        for (int d = 0; d < D; d++) sums[d] = fmaf(weights[j], vj[d], sums[d]);
    }
    for (int d = 0; d < D; d++) out[d] = sums[d] * inverse;
}

/* cpu_attention.c's causal_attention_impl, the same arguments (D at most MAX_HEAD_DIM). */
int causal_attention_impl(const float *q, const float *keys, const float *values, int n, int start, int H, int KVH,
                          int D, int capacity, float scale, const int *parents, int window, float *out, int threads) {
    return attention_by_rows(attend_row, q, keys, values, n, start, H, KVH, D, capacity, scale, parents, window, out,
                             threads);
}
