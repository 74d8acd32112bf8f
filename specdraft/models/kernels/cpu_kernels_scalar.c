/* The scalar build of the kernels: the activations' quantization, the block products of every
 * format (4-bit terms with offsets in each scale form, 8-bit, 6-bit, bfloat16 and float32
 * weights), RMSNorm and SwiGLU in plain C, no intrinsics, so that it compiles and runs on any
 * CPU (native.py builds it without -mavx2, -mfma or -mf16c and picks it where the CPU lacks
 * AVX2, FMA or F16C, or with SPECDRAFT_KERNEL_ISA=scalar). Attention: cpu_attention_scalar.c.
 *
 * It is also the reference the vector builds are held to, bit for bit
 * (tests/test_scalar_kernels.py): every float step is the one the AVX2 code takes for that
 * lane, in the same order. Integer dot products are exact whatever the order (the vector code's
 * int16 partial sums never saturate, cpu_kernels_shared.h); a fused multiply-add is fmaf (one
 * rounding, as vfmadd); a horizontal sum or maximum goes lane by lane in the tree of hsum and
 * hmax (cpu_kernels_vector.h); max follows maxps (a > b ? a : b, else b); rounding to an
 * integer is nearbyintf (nearest even, as cvtps and round_ps in the default mode); float16 is
 * widened exactly in software. -ffp-contract=off keeps the compiler from fusing anything else.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_scalar.h"

/* max |x| over `groups` groups of 32 values, as cpu_kernels.c's amax_of: 8 lanes, then hmax's
 * tree (a maximum is exact in any order; the order only matters for a NaN). */
float amax_of(const float *x, int groups) {
    float most[8] = {0};
    for (int k = 0; k < 4 * groups; k++)
        for (int l = 0; l < 8; l++) most[l] = lane_max(most[l], fabsf(x[8 * k + l]));
    return max8(most);
}

/* Groups of 32 values to int8 codes, as cpu_kernels.c's quantize_groups: each value times
 * `inverse` rounded to nearest even and clamped to -127..127; s: each group's code sum. */
void quantize_groups(const float *x, int groups, float inverse, int8_t *q, int32_t *s) {
    for (int g = 0; g < groups; g++) {
        const float *xg = x + g * GROUP;
        int32_t sum = 0;
        for (int j = 0; j < GROUP; j++) {
            int32_t code = to_int(xg[j] * inverse);
            code = code > 127 ? 127 : code < -127 ? -127 : code;
            q[g * GROUP + j] = (int8_t)code;
            sum += code;
        }
        s[g] = sum;
    }
}

/* Block b's scale (or offset) of group g for its 16 columns, widened exactly: float32, float16,
 * or factored (the uint8 factor times its super-block's float16 d, one rounding). */
static void scales16(const void *p, int b, int G, int g, int form, float *out) {
    if (form == SCALES_FACTORED) {
        const uint8_t *block = (const uint8_t *)p + (size_t)b * G * FACTORED_BYTES;
        const uint8_t *factors = block + (size_t)g * BLOCK;
        uint16_t supers[BLOCK];
        memcpy(supers, block + (size_t)G * BLOCK + 2 * (size_t)(g / SUPER_GROUPS) * BLOCK, sizeof(supers));
        for (int c = 0; c < BLOCK; c++) out[c] = (float)factors[c] * half_to_float(supers[c]);
        return;
    }
    const size_t at = ((size_t)b * G + g) * BLOCK;
    for (int c = 0; c < BLOCK; c++)
        out[c] = form == SCALES_FLOAT16 ? half_to_float(((const uint16_t *)p)[at + c]) : ((const float *)p)[at + c];
}

/* Rows m0 .. m0 + rows - 1 of 4-bit weight block b (`G` groups, `xgroups` per term): per column
 * and group the exact integer sum of the 32 code x activation products (byte j of a group:
 * code j low, code j + 16 high, at 64 (j / 4) + 4 c + j % 4), then acc = fma(isum, dx s, acc)
 * and acc = fma(ax, o, acc), as block4 in cpu_kernels.c. */
static void block4(const uint8_t *codes, const void *scale, const void *offset, int form, int G, int xgroups,
                   const Activations *a, int m0, int rows, int b, int N, float *y, int ldy) {
    const int K = xgroups * GROUP, columns = block_columns(b, N);
    float acc[SCALAR_ROWS][BLOCK] = {{0}}, s[BLOCK], o[BLOCK];
    for (int g = 0; g < G; g++) {
        const int xg = g % xgroups;
        const uint8_t *group = codes + ((size_t)b * G + g) * 256;
        scales16(scale, b, G, g, form, s);
        scales16(offset, b, G, g, form, o);
        for (int r = 0; r < rows; r++) {
            const size_t m = m0 + r;
            const int8_t *q = a->qx + m * K + xg * GROUP;
            const float dx = a->dx[m * xgroups + xg], ax = a->ax[m * xgroups + xg];
            for (int c = 0; c < columns; c++) {
                int32_t isum = 0;
                for (int j = 0; j < 16; j++) {
                    const uint8_t byte = group[64 * (j / 4) + 4 * c + j % 4];
                    isum += (byte & 0x0F) * q[j] + (byte >> 4) * q[j + 16];
                }
                acc[r][c] = fmaf((float)isum, dx * s[c], acc[r][c]);
                acc[r][c] = fmaf(ax, o[c], acc[r][c]);
            }
        }
    }
    store_rows(acc, rows, m0, b, columns, y, ldy);
}

/* The same for int8 codes (code j at 64 (j / 4) + 4 c + j % 4), no offsets. */
static void block8(const int8_t *codes, const void *scale, int form, int G, const Activations *a, int m0, int rows,
                   int b, int N, float *y, int ldy) {
    const int K = G * GROUP, columns = block_columns(b, N);
    float acc[SCALAR_ROWS][BLOCK] = {{0}}, s[BLOCK];
    for (int g = 0; g < G; g++) {
        const int8_t *group = codes + ((size_t)b * G + g) * 512;
        scales16(scale, b, G, g, form, s);
        for (int r = 0; r < rows; r++) {
            const size_t m = m0 + r;
            const int8_t *q = a->qx + m * K + (size_t)g * GROUP;
            const float dx = a->dx[m * G + g];
            for (int c = 0; c < columns; c++) {
                int32_t isum = 0;
                for (int j = 0; j < GROUP; j++) isum += group[64 * (j / 4) + 4 * c + j % 4] * q[j];
                acc[r][c] = fmaf((float)isum, dx * s[c], acc[r][c]);
            }
        }
    }
    store_rows(acc, rows, m0, b, columns, y, ldy);
}

/* 6-bit weights: each half group's exact sum of (code - 32) x activation (formed as the vector
 * code forms it, sum(code x) - 32 sx16: the same integer), then per half acc = fma(sum, dx s,
 * acc), s = factor x d, as block6 in cpu_kernels_six.c. */
static void block6(const uint8_t *codes, const uint8_t *scales, int G, const Activations *a, int m0, int rows, int b,
                   int N, float *y, int ldy) {
    const int K = G * GROUP, columns = block_columns(b, N);
    const uint8_t *block = scales + (size_t)b * G * SIX_SCALE_BYTES;
    float acc[SCALAR_ROWS][BLOCK] = {{0}};
    for (int g = 0; g < G; g++) {
        const uint8_t *group = codes + ((size_t)b * G + g) * SIX_GROUP_BYTES;
        int32_t code[BLOCK][GROUP];
        float s[2][BLOCK];
        for (int c = 0; c < columns; c++) {
            six_codes(group, c, code[c]);
            uint16_t d;
            memcpy(&d, block + (size_t)G * 2 * BLOCK + 2 * ((g / SUPER_GROUPS) * BLOCK + c), 2);
            for (int part = 0; part < 2; part++)
                s[part][c] = (float)((const int8_t *)block)[(size_t)g * 2 * BLOCK + part * BLOCK + c] * half_to_float(d);
        }
        for (int r = 0; r < rows; r++) {
            const size_t m = m0 + r;
            const int8_t *q = a->qx + m * K + (size_t)g * GROUP;
            const float dx = a->dx[m * G + g];
            const int32_t minus0 = 32 * a->sx16[(m * G + g) * 2], minus1 = 32 * a->sx16[(m * G + g) * 2 + 1];
            for (int c = 0; c < columns; c++) {
                int32_t sum0 = 0, sum1 = 0;
                for (int j = 0; j < 16; j++) {
                    sum0 += code[c][j] * q[j];
                    sum1 += code[c][j + 16] * q[j + 16];
                }
                acc[r][c] = fmaf((float)(sum0 - minus0), dx * s[0][c], acc[r][c]);
                acc[r][c] = fmaf((float)(sum1 - minus1), dx * s[1][c], acc[r][c]);
            }
        }
    }
    store_rows(acc, rows, m0, b, columns, y, ldy);
}

/* Float weights (bits 16: bfloat16 widened exactly; 32: float32): per column one fused
 * multiply-add per k in order, as block_float in cpu_kernels.c. */
static void block_float(const void *w, int bits, int K, const float *x, int m0, int rows, int b, int N, float *y,
                        int ldy) {
    const int columns = block_columns(b, N);
    const size_t base = (size_t)b * K * BLOCK;
    float acc[SCALAR_ROWS][BLOCK] = {{0}};
    for (int k = 0; k < K; k++) {
        float weight[BLOCK];
        for (int c = 0; c < columns; c++) {
            if (bits == 16) {
                const uint32_t widened = (uint32_t)((const uint16_t *)w)[base + (size_t)k * BLOCK + c] << 16;
                memcpy(&weight[c], &widened, 4);
            } else {
                weight[c] = ((const float *)w)[base + (size_t)k * BLOCK + c];
            }
        }
        for (int r = 0; r < rows; r++) {
            const float v = x[(size_t)(m0 + r) * K + k];
            for (int c = 0; c < columns; c++) acc[r][c] = fmaf(v, weight[c], acc[r][c]);
        }
    }
    store_rows(acc, rows, m0, b, columns, y, ldy);
}

/* y [M, N] (row stride ldy) = the activations `a` times a weight in the block layout
 * (cpu_kernels.c's block_products, the same arguments). */
void block_products(const Activations *a, int M, int K, const void *codes, const void *scale, const void *offset,
                    int form, int bits, int N, int groups, float *y, int ldy, int threads) {
    const int blocks = (N + BLOCK - 1) / BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++)
        for (int m0 = 0; m0 < M; m0 += SCALAR_ROWS) {
            const int rows = M - m0 < SCALAR_ROWS ? M - m0 : SCALAR_ROWS;
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

/* RMSNorm of each row, as cpu_kernels.c's: the squares summed in 8 lanes (a fused
 * multiply-add each) over the whole vectors, the lanes in hsum's tree, the rest added after
 * one at a time; then x / sqrt(mean + eps), times the weight. */
void rms_norm_impl(const float *x, const float *weight, int rows, int dim, float eps, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *o = out + (size_t)r * dim, lanes[8] = {0};
        int d = 0;
        for (; d + 8 <= dim; d += 8)
            for (int l = 0; l < 8; l++) lanes[l] = fmaf(xr[d + l], xr[d + l], lanes[l]);
        float total = sum8(lanes);
        for (; d < dim; d++) total += xr[d] * xr[d];
        const float scale = 1.0f / sqrtf(total / (float)dim + eps);
        for (d = 0; d < dim; d++) o[d] = xr[d] * scale * weight[d];
    }
}

/* silu(gate) * up, as cpu_kernels.c's swiglu: the whole vectors through exp_nonpositive (t =
 * e^-|x|, 0 below -87; t / (1 + t) where x's sign bit is set, 1 / (1 + t) elsewhere), the rest
 * through expf. */
void swiglu_impl(const float *gate_up, int rows, int inner, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inner, *u = g + inner;
        float *o = out + (size_t)r * inner;
        const int whole = inner - inner % 8; /* what the vector code takes in vectors */
        int i = 0;
        for (; i < whole; i++) {
            const float x = g[i], negative = -fabsf(x);
            const float t = negative < -87.0f ? 0.0f : exp_nonpositive(negative);
            const float silu = x * ((signbit(x) ? t : 1.0f) / (1.0f + t));
            o[i] = silu * u[i];
        }
        for (; i < inner; i++) {
            const float t = expf(-fabsf(g[i]));
            o[i] = g[i] * ((g[i] < 0.0f ? t : 1.0f) / (1.0f + t)) * u[i];
        }
    }
}
