/* The scalar build's lane helpers (cpu_kernels_scalar.c, cpu_attention_scalar.c): plain C that
 * does, for one lane or across eight, what cpu_kernels_vector.h's vector helpers do, operation
 * for operation, so that the two builds' numbers are the same bit for bit.
 */
#ifndef SPECDRAFT_CPU_KERNELS_SCALAR_H
#define SPECDRAFT_CPU_KERNELS_SCALAR_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels_shared.h"

/* maxps for one lane: a when a > b, else b (equal values, a NaN: b). */
static inline float lane_max(float a, float b) { return a > b ? a : b; }

/* hsum's order over eight lanes: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)). */
static inline float sum8(const float *v) {
    const float t0 = v[0] + v[4], t1 = v[1] + v[5], t2 = v[2] + v[6], t3 = v[3] + v[7];
    return (t0 + t2) + (t1 + t3);
}

/* hmax's order, the same tree of lane_max. */
static inline float max8(const float *v) {
    const float m0 = lane_max(v[0], v[4]), m1 = lane_max(v[1], v[5]), m2 = lane_max(v[2], v[6]),
                m3 = lane_max(v[3], v[7]);
    return lane_max(lane_max(m0, m2), lane_max(m1, m3));
}

/* cvtps2dq: to the nearest integer, ties to even; a NaN or a value out of int32's range gives
 * INT32_MIN (the "integer indefinite" value). */
static inline int32_t to_int(float v) {
    if (!(v >= -2147483648.0f && v < 2147483648.0f)) return INT32_MIN;
    return (int32_t)nearbyintf(v);
}

/* exp_nonpositive for one lane (Cephes' polynomial), step for step. */
static inline float exp_nonpositive(float x) {
    x = lane_max(x, -87.0f);
    const float fx = nearbyintf(x * 1.44269504088896341f);
    x = x - fx * 0.693359375f;
    x = x - fx * -2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = fmaf(y, x, 1.3981999507e-3f);
    y = fmaf(y, x, 8.3334519073e-3f);
    y = fmaf(y, x, 4.1665795894e-2f);
    y = fmaf(y, x, 1.6666665459e-1f);
    y = fmaf(y, x, 5.0000001201e-1f);
    y = fmaf(y, x * x, x + 1.0f);
    const uint32_t bits = (uint32_t)(to_int(fx) + 127) << 23;
    float power;
    memcpy(&power, &bits, 4);
    return y * power;
}

/* Rows m0 .. m0 + rows - 1 of block b's `columns` columns from acc into y (row stride ldy). */
static inline void store_rows(float acc[SCALAR_ROWS][BLOCK], int rows, int m0, int b, int columns, float *y,
                              int ldy) {
    for (int r = 0; r < rows; r++)
        memcpy(y + (size_t)(m0 + r) * ldy + (size_t)b * BLOCK, acc[r], sizeof(float) * columns);
}

#endif
