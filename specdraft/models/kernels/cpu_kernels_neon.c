/* The ARM NEON build of the kernels (AArch64): the activations' quantization, the block
 * products of every format (4-bit terms with offsets in each scale form, 8-bit, 6-bit,
 * bfloat16 and float32 weights), RMSNorm and SwiGLU; attention: cpu_attention_neon.c.
 *
 * The same numbers as the scalar build (cpu_kernels_scalar.c) and so as AVX2, bit for bit
 * (tests/test_neon_kernels.py runs the two under qemu and compares them): a vector lane is a
 * column, as on x86 (cpu_kernels_shared.h's layout); a column's integer sums are exact whatever
 * instruction forms them (dot4, cpu_kernels_neon.h); each float step is the scalar build's for
 * that lane, in its order: vfmaq where it has fmaf, a separate multiply and add where it has
 * those (-ffp-contract=off keeps the compiler from fusing them).
 */
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_neon.h"

/* max |x| over `groups` groups of 32 values, as cpu_kernels_scalar.c's amax_of. */
float amax_of(const float *x, int groups) {
    float32x4_t most_lo = vdupq_n_f32(0.0f), most_hi = vdupq_n_f32(0.0f);
    for (int k = 0; k < 4 * groups; k++) {
        most_lo = lane_max4(most_lo, vabsq_f32(vld1q_f32(x + 8 * k)));
        most_hi = lane_max4(most_hi, vabsq_f32(vld1q_f32(x + 8 * k + 4)));
    }
    return max8(most_lo, most_hi);
}

/* Groups of 32 values to int8 codes, as cpu_kernels_scalar.c's quantize_groups. */
void quantize_groups(const float *x, int groups, float inverse, int8_t *q, int32_t *s) {
    for (int g = 0; g < groups; g++) {
        const float *xg = x + g * GROUP;
        int32x4_t sum = vdupq_n_s32(0), codes[8];
        for (int k = 0; k < 8; k++) {
            codes[k] = to_int4(vmulq_n_f32(vld1q_f32(xg + 4 * k), inverse));
            codes[k] = vmaxq_s32(vminq_s32(codes[k], vdupq_n_s32(127)), vdupq_n_s32(-127));
            sum = vaddq_s32(sum, codes[k]);
        }
        for (int k = 0; k < 8; k += 2) {
            const int16x8_t pair = vcombine_s16(vmovn_s32(codes[k]), vmovn_s32(codes[k + 1]));
            vst1_s8(q + g * GROUP + 4 * k, vmovn_s16(pair));
        }
        s[g] = vaddvq_s32(sum);
    }
}

/* Block b's scale (or offset) of group g for its 16 columns, widened exactly (scales16 of
 * cpu_kernels_scalar.c): float32, float16, or factored (uint8 factor x float16 d, one rounding). */
static inline __attribute__((always_inline)) void scales16(const void *p, int b, int G, int g, int form,
                                                          float32x4_t *out) {
    if (form == SCALES_FACTORED) {
        const uint8_t *block = (const uint8_t *)p + (size_t)b * G * FACTORED_BYTES;
        float32x4_t d[4];
        widen16((const uint16_t *)(block + (size_t)G * BLOCK + 2 * (size_t)(g / SUPER_GROUPS) * BLOCK), d);
        const uint8x16_t factors = vld1q_u8(block + (size_t)g * BLOCK);
        const uint16x8_t low = vmovl_u8(vget_low_u8(factors)), high = vmovl_high_u8(factors);
        const uint32x4_t wide[4] = {vmovl_u16(vget_low_u16(low)), vmovl_high_u16(low), vmovl_u16(vget_low_u16(high)),
                                    vmovl_high_u16(high)};
        for (int k = 0; k < 4; k++) out[k] = vmulq_f32(vcvtq_f32_u32(wide[k]), d[k]);
        return;
    }
    const size_t at = ((size_t)b * G + g) * BLOCK;
    if (form == SCALES_FLOAT16) {
        widen16((const uint16_t *)p + at, out);
        return;
    }
    for (int k = 0; k < 4; k++) out[k] = vld1q_f32((const float *)p + at + 4 * k);
}

/* Rows m0 .. m0 + rows - 1 of block b's `columns` columns from acc into y (row stride ldy). */
static inline __attribute__((always_inline)) void store_rows(float32x4_t acc[NEON_ROWS][4], int rows, int m0, int b,
                                                            int columns, float *y, int ldy) {
    for (int r = 0; r < rows; r++) {
        float row[BLOCK];
        for (int k = 0; k < 4; k++) vst1q_f32(row + 4 * k, acc[r][k]);
        memcpy(y + (size_t)(m0 + r) * ldy + (size_t)b * BLOCK, row, sizeof(float) * columns);
    }
}

/* 4-bit weight block b (`G` groups, `xgroups` per term): the group's nibbles split once for
 * all rows (chunk k, columns 4u .. 4u + 3: codes 4k .. 4k + 3 low, 16 + 4k .. high), each
 * column's exact integer sum, then acc = fma(isum, dx s, acc), acc = fma(ax, o, acc). */
static void block4(const uint8_t *codes, const void *scale, const void *offset, int form, int G, int xgroups,
                   const Activations *a, int m0, int rows, int b, int N, float *y, int ldy) {
    const int K = xgroups * GROUP;
    float32x4_t acc[NEON_ROWS][4];
    for (int r = 0; r < NEON_ROWS; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = vdupq_n_f32(0.0f);
    for (int g = 0; g < G; g++) {
        const int xg = g % xgroups;
        const uint8_t *group = codes + ((size_t)b * G + g) * 256;
        float32x4_t s[4], o[4];
        scales16(scale, b, G, g, form, s);
        scales16(offset, b, G, g, form, o);
        int8x16_t low[4][4], high[4][4];
        for (int k = 0; k < 4; k++)
            for (int u = 0; u < 4; u++) {
                const uint8x16_t w = vld1q_u8(group + 64 * k + 16 * u);
                low[k][u] = vreinterpretq_s8_u8(vandq_u8(w, vdupq_n_u8(0x0F)));
                high[k][u] = vreinterpretq_s8_u8(vshrq_n_u8(w, 4));
            }
        for (int r = 0; r < rows; r++) {
            const size_t m = m0 + r;
            const int8_t *q = a->qx + m * K + xg * GROUP;
            int32x4_t isum[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int k = 0; k < 4; k++) {
                const int8x16_t ql = broadcast4(q + 4 * k), qh = broadcast4(q + 16 + 4 * k);
                for (int u = 0; u < 4; u++) isum[u] = dot4(dot4(isum[u], low[k][u], ql), high[k][u], qh);
            }
            const float dx = a->dx[m * xgroups + xg];
            const float32x4_t ax = vdupq_n_f32(a->ax[m * xgroups + xg]);
            for (int u = 0; u < 4; u++) {
                acc[r][u] = vfmaq_f32(acc[r][u], vcvtq_f32_s32(isum[u]), vmulq_n_f32(s[u], dx));
                acc[r][u] = vfmaq_f32(acc[r][u], ax, o[u]);
            }
        }
    }
    store_rows(acc, rows, m0, b, block_columns(b, N), y, ldy);
}

/* The same for int8 codes (chunk k of 8: codes 4k .. 4k + 3 of each column), no offsets. */
static void block8(const int8_t *codes, const void *scale, int form, int G, const Activations *a, int m0, int rows,
                   int b, int N, float *y, int ldy) {
    const int K = G * GROUP;
    float32x4_t acc[NEON_ROWS][4];
    for (int r = 0; r < NEON_ROWS; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = vdupq_n_f32(0.0f);
    for (int g = 0; g < G; g++) {
        const int8_t *group = codes + ((size_t)b * G + g) * 512;
        float32x4_t s[4];
        scales16(scale, b, G, g, form, s);
        for (int r = 0; r < rows; r++) {
            const size_t m = m0 + r;
            const int8_t *q = a->qx + m * K + (size_t)g * GROUP;
            int32x4_t isum[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int k = 0; k < 8; k++) {
                const int8x16_t qk = broadcast4(q + 4 * k);
                for (int u = 0; u < 4; u++) isum[u] = dot4(isum[u], vld1q_s8(group + 64 * k + 16 * u), qk);
            }
            const float dx = a->dx[m * G + g];
            for (int u = 0; u < 4; u++) acc[r][u] = vfmaq_f32(acc[r][u], vcvtq_f32_s32(isum[u]), vmulq_n_f32(s[u], dx));
        }
    }
    store_rows(acc, rows, m0, b, block_columns(b, N), y, ldy);
}

/* 6-bit weights: codes = the 4-bit layout's nibble | the top two bits << 4 (cpu_kernels_shared.h;
 * column 4u + l's top bytes sit at 256 + 64 (u / 2) + 32 part + 16 (u % 2) + 4 l), each half
 * group's sum(code x) - 32 sx16 exactly, then per half acc = fma(sum, dx s, acc), s = factor x
 * d, as block6 of cpu_kernels_scalar.c. */
static void block6(const uint8_t *codes, const uint8_t *scales, int G, const Activations *a, int m0, int rows, int b,
                   int N, float *y, int ldy) {
    const int K = G * GROUP;
    const uint8_t *block = scales + (size_t)b * G * SIX_SCALE_BYTES;
    float32x4_t acc[NEON_ROWS][4];
    for (int r = 0; r < NEON_ROWS; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = vdupq_n_f32(0.0f);
    for (int g = 0; g < G; g++) {
        const uint8_t *group = codes + ((size_t)b * G + g) * SIX_GROUP_BYTES;
        float32x4_t d[4], s[2][4];
        widen16((const uint16_t *)(block + (size_t)G * 2 * BLOCK + 2 * (size_t)(g / SUPER_GROUPS) * BLOCK), d);
        for (int part = 0; part < 2; part++) {
            const int8x16_t factors = vld1q_s8((const int8_t *)block + (size_t)g * 2 * BLOCK + part * BLOCK);
            const int16x8_t low = vmovl_s8(vget_low_s8(factors)), high = vmovl_high_s8(factors);
            const int32x4_t wide[4] = {vmovl_s16(vget_low_s16(low)), vmovl_high_s16(low),
                                       vmovl_s16(vget_low_s16(high)), vmovl_high_s16(high)};
            for (int u = 0; u < 4; u++) s[part][u] = vmulq_f32(vcvtq_f32_s32(wide[u]), d[u]);
        }
        int8x16_t first[4][4], second[4][4]; /* [k][u]: codes 4k .. 4k + 3 and 16 + 4k .. of columns 4u .. */
        for (int u = 0; u < 4; u++) {
            const uint8_t *top = group + 256 + 64 * (u / 2) + 16 * (u % 2);
            const uint8x16_t top0 = vld1q_u8(top), top1 = vld1q_u8(top + 32), three = vdupq_n_u8(3);
            for (int k = 0; k < 4; k++) {
                const uint8x16_t w = vld1q_u8(group + 64 * k + 16 * u);
                const int8x16_t shift = vdupq_n_s8((int8_t)(-2 * k));
                const uint8x16_t high0 = vandq_u8(vshlq_u8(top0, shift), three);
                const uint8x16_t high1 = vandq_u8(vshlq_u8(top1, shift), three);
                first[k][u] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(w, vdupq_n_u8(0x0F)), vshlq_n_u8(high0, 4)));
                second[k][u] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(w, 4), vshlq_n_u8(high1, 4)));
            }
        }
        for (int r = 0; r < rows; r++) {
            const size_t m = m0 + r;
            const int8_t *q = a->qx + m * K + (size_t)g * GROUP;
            int32x4_t sum0[4], sum1[4];
            for (int u = 0; u < 4; u++) sum0[u] = sum1[u] = vdupq_n_s32(0);
            for (int k = 0; k < 4; k++) {
                const int8x16_t q0 = broadcast4(q + 4 * k), q1 = broadcast4(q + 16 + 4 * k);
                for (int u = 0; u < 4; u++) {
                    sum0[u] = dot4(sum0[u], first[k][u], q0);
                    sum1[u] = dot4(sum1[u], second[k][u], q1);
                }
            }
            const float dx = a->dx[m * G + g];
            const int32x4_t minus0 = vdupq_n_s32(32 * a->sx16[(m * G + g) * 2]);
            const int32x4_t minus1 = vdupq_n_s32(32 * a->sx16[(m * G + g) * 2 + 1]);
            for (int u = 0; u < 4; u++) {
                acc[r][u] = vfmaq_f32(acc[r][u], vcvtq_f32_s32(vsubq_s32(sum0[u], minus0)), vmulq_n_f32(s[0][u], dx));
                acc[r][u] = vfmaq_f32(acc[r][u], vcvtq_f32_s32(vsubq_s32(sum1[u], minus1)), vmulq_n_f32(s[1][u], dx));
            }
        }
    }
    store_rows(acc, rows, m0, b, block_columns(b, N), y, ldy);
}

/* Float weights (bits 16: bfloat16 widened exactly; 32: float32): per column one fused
 * multiply-add per k in order. */
static void block_float(const void *w, int bits, int K, const float *x, int m0, int rows, int b, int N, float *y,
                        int ldy) {
    const size_t base = (size_t)b * K * BLOCK;
    float32x4_t acc[NEON_ROWS][4];
    for (int r = 0; r < NEON_ROWS; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = vdupq_n_f32(0.0f);
    for (int k = 0; k < K; k++) {
        float32x4_t weight[4];
        for (int u = 0; u < 4; u++) {
            const size_t at = base + (size_t)k * BLOCK + 4 * u;
            weight[u] = bits == 16 ? vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)w + at), 16))
                                   : vld1q_f32((const float *)w + at);
        }
        for (int r = 0; r < rows; r++) {
            const float32x4_t v = vdupq_n_f32(x[(size_t)(m0 + r) * K + k]);
            for (int u = 0; u < 4; u++) acc[r][u] = vfmaq_f32(acc[r][u], v, weight[u]);
        }
    }
    store_rows(acc, rows, m0, b, block_columns(b, N), y, ldy);
}

/* y [M, N] (row stride ldy) = the activations `a` times a weight in the block layout
 * (cpu_kernels_scalar.c's block_products, the same arguments). */
void block_products(const Activations *a, int M, int K, const void *codes, const void *scale, const void *offset,
                    int form, int bits, int N, int groups, float *y, int ldy, int threads) {
    const int blocks = (N + BLOCK - 1) / BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++)
        for (int m0 = 0; m0 < M; m0 += NEON_ROWS) {
            const int rows = M - m0 < NEON_ROWS ? M - m0 : NEON_ROWS;
            if (FLOAT_WEIGHTS(bits))
                block_float(codes, bits, K, a->x, m0, rows, b, N, y, ldy);
            else if (bits == 6)
                block6((const uint8_t *)codes, (const uint8_t *)scale, K / GROUP, a, m0, rows, b, N, y, ldy);
            else if (bits == 8)
                block8((const int8_t *)codes, scale, form, K / GROUP, a, m0, rows, b, N, y, ldy);
            else
                block4((const uint8_t *)codes, scale, offset, form, groups, K / GROUP, a, m0, rows, b, N, y, ldy);
        }
}

/* RMSNorm of each row, as cpu_kernels_scalar.c's: the squares in 8 lanes (lo, hi), hsum's tree,
 * the rest one at a time; then x / sqrt(mean + eps), times the weight. */
void rms_norm_impl(const float *x, const float *weight, int rows, int dim, float eps, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *o = out + (size_t)r * dim;
        float32x4_t lo = vdupq_n_f32(0.0f), hi = vdupq_n_f32(0.0f);
        int d = 0;
        for (; d + 8 <= dim; d += 8) {
            const float32x4_t x0 = vld1q_f32(xr + d), x1 = vld1q_f32(xr + d + 4);
            lo = vfmaq_f32(lo, x0, x0);
            hi = vfmaq_f32(hi, x1, x1);
        }
        float total = sum8(lo, hi);
        for (; d < dim; d++) total += xr[d] * xr[d];
        const float scale = 1.0f / sqrtf(total / (float)dim + eps);
        for (d = 0; d + 4 <= dim; d += 4)
            vst1q_f32(o + d, vmulq_f32(vmulq_n_f32(vld1q_f32(xr + d), scale), vld1q_f32(weight + d)));
        for (; d < dim; d++) o[d] = xr[d] * scale * weight[d];
    }
}

/* silu(gate) * up, as cpu_kernels_scalar.c's swiglu_impl: the first inner - inner % 8 through
 * exp_nonpositive4, the rest through expf. */
void swiglu_impl(const float *gate_up, int rows, int inner, float *out) {
    const float32x4_t one = vdupq_n_f32(1.0f), zero = vdupq_n_f32(0.0f), floor = vdupq_n_f32(-87.0f);
    const uint32x4_t sign = vdupq_n_u32(0x80000000u);
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inner, *u = g + inner;
        float *o = out + (size_t)r * inner;
        const int whole = inner - inner % 8;
        int i = 0;
        for (; i < whole; i += 4) {
            const float32x4_t x = vld1q_f32(g + i), negative = vnegq_f32(vabsq_f32(x));
            const float32x4_t t = vbslq_f32(vcltq_f32(negative, floor), zero, exp_nonpositive4(negative));
            const float32x4_t above = vbslq_f32(vtstq_u32(vreinterpretq_u32_f32(x), sign), t, one);
            const float32x4_t silu = vmulq_f32(x, vdivq_f32(above, vaddq_f32(one, t)));
            vst1q_f32(o + i, vmulq_f32(silu, vld1q_f32(u + i)));
        }
        for (; i < inner; i++) {
            const float t = expf(-fabsf(g[i]));
            o[i] = g[i] * ((g[i] < 0.0f ? t : 1.0f) / (1.0f + t)) * u[i];
        }
    }
}
