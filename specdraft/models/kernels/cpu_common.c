/* What every build of the kernels shares, in plain C (compiled into the scalar, AVX2, VNNI and
 * NEON libraries alike; each links it to its own amax_of and quantize_groups, products, norms
 * and attention):
 * the activations a product quantizes, the residual update before a norm, a weight's rows
 * looked up (block_rows: an embedding tied to the head), the rotary positions and KV write
 * before attention, and the parallel loop of the builds that attend row by row. None of it is vector code of its own, and none of it depends on a build: the same
 * numbers everywhere. The build flags keep the compiler from fusing a multiply and an add
 * (-ffp-contract=off), so what auto-vectorized code computes is what these lines say.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_scalar.h"

void free_activations(Activations *a) {
    free(a->dx); /* (one allocation holds every array, dx first: prepare_activations) */
}

/* v rounded to nearest even, for |v| < 2^22: the bits of v + 1.5 x 2^23 (llama.cpp's nearest_int,
 * which rounds Q8_K's codes; what its AVX rounding gives Q8_0's): no library call, the same in
 * every build. */
static inline int32_t nearest_int(float v) {
    const float shifted = v + 12582912.0f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    return (bits & 0x007fffff) - 0x00400000;
}

/* `value` rounded to float16 and back, to nearest even, subnormals included (as the F16C
 * conversion llama.cpp's GGML_CPU_FP32_TO_FP16 uses on x86); beyond float16's range: inf. */
static float half_rounded(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t sign = bits & 0x80000000u, magnitude = bits & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) return value;                                /* inf, nan */
    if (magnitude >= 0x477ff000u) return sign ? -INFINITY : INFINITY;          /* >= 65520 */
    if (magnitude < 0x38800000u) {                  /* below 2^-14: a float16 subnormal, steps of 2^-24 */
        const float rounded = (float)nearest_int(fabsf(value) * 16777216.0f) * 5.9604644775390625e-08f;
        return sign ? -rounded : rounded;
    }
    /* a normal float16 keeps 10 of the 23 mantissa bits: the 13 dropped rounded to nearest even */
    const uint32_t kept = (magnitude + 0x00000fffu + ((magnitude >> 13) & 1u)) & ~0x00001fffu;
    const uint32_t out = sign | kept;
    float result;
    memcpy(&result, &out, sizeof result);
    return result;
}

/* A row's groups of 32 with a float32 scale amax / 127 each (ACTIVATIONS_OWN). */
static void quantize_row_own(const float *x, int groups, int8_t *q, float *d, int32_t *s, float *ax) {
    for (int g = 0; g < groups; g++) {
        const float scale = amax_of(x + (size_t)g * GROUP, 1) / 127.0f;
        quantize_groups(x + (size_t)g * GROUP, 1, scale > 0.0f ? 1.0f / scale : 0.0f, q + (size_t)g * GROUP, s + g);
        d[g] = scale;
        ax[g] = scale * (float)s[g];
    }
}

/* A row's groups of 32 as llama.cpp's quantize_row_q8_0 / _q8_1 (x86) round them: codes
 * x x 127 / amax, the scale amax / 127 stored in float16; `q8_1`: also the offsets' weight
 * d x sum rounded to float16 (d before its rounding). */
static void quantize_row_q8_0(const float *x, int groups, int q8_1, int8_t *q, float *d, int32_t *s, float *ax) {
    for (int g = 0; g < groups; g++) {
        const float amax = amax_of(x + (size_t)g * GROUP, 1), scale = amax / 127.0f;
        quantize_groups(x + (size_t)g * GROUP, 1, amax != 0.0f ? 127.0f / amax : 0.0f, q + (size_t)g * GROUP, s + g);
        d[g] = half_rounded(scale);
        ax[g] = q8_1 ? half_rounded(scale * (float)s[g]) : d[g] * (float)s[g];
    }
}

/* A row's super-blocks of SUPER_GROUPS groups as llama.cpp's quantize_row_q8_K_ref rounds
 * them: the value of largest magnitude (the first such) gives iscale = -127 / max, codes
 * iscale x x, and d = 1 / iscale for every group of the block. */
static void quantize_row_q8_k(const float *x, int groups, int8_t *q, float *d, int32_t *s, float *ax) {
    for (int b = 0; b < groups / SUPER_GROUPS; b++) {
        const float *xb = x + (size_t)b * SUPER_GROUPS * GROUP;
        const float amax = amax_of(xb, SUPER_GROUPS);
        float max = 0.0f;
        for (int j = 0; j < SUPER_GROUPS * GROUP && amax != 0.0f; j++)
            if (fabsf(xb[j]) == amax) { max = xb[j]; break; }
        const float iscale = amax != 0.0f ? -127.0f / max : 0.0f, scale = amax != 0.0f ? 1.0f / iscale : 0.0f;
        quantize_groups(xb, SUPER_GROUPS, iscale, q + (size_t)b * SUPER_GROUPS * GROUP, s + b * SUPER_GROUPS);
        for (int g = b * SUPER_GROUPS; g < (b + 1) * SUPER_GROUPS; g++) {
            d[g] = scale;
            ax[g] = scale * (float)s[g];
        }
    }
}

int activations_of(const Matrix *w) {
    return FLOAT_WEIGHTS(w->bits) ? ACTIVATIONS_FLOAT : w->activations;
}

/* Returns 0, or KERNEL_NO_MEMORY (then nothing is left allocated). The rule was checked
 * (ACTIVATIONS_Q8_K: K a multiple of SUPER_GROUPS groups; cpu_boundary.c). `halves`: also the
 * code sums of each half group (sx16), which only 6-bit weights read. The arrays share one
 * allocation: a projection prepares activations per layer and part, so a verify step would
 * otherwise make hundreds of small allocations. */
int prepare_activations(const float *x, int M, int K, int rule, int halves, Activations *a) {
    const size_t groups = (size_t)(K / GROUP), rows = (size_t)M;
    a->x = x;
    a->qx = NULL; a->dx = NULL; a->sx = NULL; a->ax = NULL; a->sx16 = NULL;
    if (rule == ACTIVATIONS_FLOAT) return 0;
    /* the 4-byte arrays first (aligned), the codes last */
    const size_t words = rows * groups * (3 + (halves ? 2 : 0));
    char *block = (char *)malloc(sizeof(float) * words + rows * (size_t)K);
    if (!block) return KERNEL_NO_MEMORY;
    a->dx = (float *)block;
    a->ax = a->dx + rows * groups;
    a->sx = (int32_t *)(a->ax + rows * groups);
    a->sx16 = halves ? a->sx + rows * groups : NULL;
    a->qx = (int8_t *)(block + sizeof(float) * words);
    for (int m = 0; m < M; m++) {
        const float *row = x + (size_t)m * K;
        int8_t *q = a->qx + (size_t)m * K;
        float *d = a->dx + (size_t)m * groups, *ax = a->ax + (size_t)m * groups;
        int32_t *s = a->sx + (size_t)m * groups;
        if (rule == ACTIVATIONS_Q8_K) {
            quantize_row_q8_k(row, (int)groups, q, d, s, ax);
        } else if (rule == ACTIVATIONS_Q8_0 || rule == ACTIVATIONS_Q8_1) {
            quantize_row_q8_0(row, (int)groups, rule == ACTIVATIONS_Q8_1, q, d, s, ax);
        } else {
            quantize_row_own(row, (int)groups, q, d, s, ax);
        }
    }
    for (size_t i = 0; halves && i < rows * groups * 2; i++) {
        int32_t total = 0;
        for (int j = 0; j < 16; j++) total += a->qx[16 * i + j];
        a->sx16[i] = total;
    }
    return 0;
}

/* gelu(gate) x up for gate_up [rows, 2 inner] -> out [rows, inner], gelu in its tanh form
 * 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (Gemma's MLP), tanh(y) as
 * sign(y) (1 - e) / (1 + e) with e = exp(-2 |y|) from the scalar build's exp_nonpositive: plain
 * C, one element at a time, so every build computes the same numbers. */
void geglu_impl(const float *gate_up, int rows, int inner, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inner, *u = g + inner;
        for (int i = 0; i < inner; i++) {
            const float x = g[i], y = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
            const float e = exp_nonpositive(-2.0f * fabsf(y));
            const float magnitude = (1.0f - e) / (1.0f + e);
            const float tanh_y = y < 0.0f ? -magnitude : magnitude;
            out[(size_t)r * inner + i] = 0.5f * x * (1.0f + tanh_y) * u[i];
        }
    }
}

/* x += delta, then out = RMSNorm(x) * weight, row by row (the residual stream's update and
 * the next layer input's norm in one pass). */
void add_rms_norm_impl(float *x, const float *delta, const float *weight, int rows, int dim, float eps, float *out) {
    for (size_t i = 0; i < (size_t)rows * dim; i++) x[i] += delta[i];
    rms_norm_impl(x, weight, rows, dim, eps, out);
}

/* Column c of block b's group g dequantized into value[32]: (code - 32) x (factor x d), one
 * rounding per weight, as the `gguf` package computes Q6_K and Q3_K (d x scale, then x q). */
/* Group g's 32 codes 0..63 of column c of a 6-bit block (cpu_kernels_shared.h SIX_*):
   the scalar products' codes and, scaled, block_rows' values. */
void six_codes(const uint8_t *group, int c, int32_t *code) {
    const int h = c / 8, lane = c % 8;
    for (int j = 0; j < GROUP; j++) {
        const int part = j / 16, k = (j % 16) / 4, i = j % 4;
        const uint8_t byte = group[64 * k + 4 * c + i];
        const int low = part ? byte >> 4 : byte & 0x0F;
        const int high = (group[256 + 64 * h + 32 * part + 4 * lane + i] >> (2 * k)) & 0x03;
        code[j] = low | (high << 4);
    }
}

static void six_group_values(const uint8_t *codes, const uint8_t *scales, int G, int b, int g, int c, float *value) {
    const uint8_t *block = scales + (size_t)b * G * SIX_SCALE_BYTES;
    uint16_t super;
    memcpy(&super, block + (size_t)G * 2 * BLOCK + 2 * ((g / SUPER_GROUPS) * BLOCK + c), 2);
    const float d = half_to_float(super);
    int32_t code[GROUP];
    six_codes(codes + ((size_t)b * G + g) * SIX_GROUP_BYTES, c, code);
    for (int j = 0; j < GROUP; j++) {
        const float scale = (float)((const int8_t *)block)[(size_t)g * 2 * BLOCK + (j / 16) * BLOCK + c] * d;
        value[j] = (float)(code[j] - 32) * scale;
    }
}

/* Column c's scale or offset of block b's group g (G groups), in any form, widened exactly. */
static inline float scale_at(const void *p, int b, int G, int g, int c, int form) {
    const size_t at = ((size_t)b * G + g) * BLOCK + c;
    if (form == SCALES_FLOAT16) return half_to_float(((const uint16_t *)p)[at]);
    if (form == SCALES_FACTORED) {
        const uint8_t *block = (const uint8_t *)p + (size_t)b * G * FACTORED_BYTES;
        const uint16_t *supers = (const uint16_t *)(block + (size_t)G * BLOCK);
        return (float)block[(size_t)g * BLOCK + c] * half_to_float(supers[(g / SUPER_GROUPS) * BLOCK + c]);
    }
    return ((const float *)p)[at];
}

/* Rows `ids` [n] of a 4-bit (`terms` terms) or 8-bit weight of N output rows in the block
 * layout, dequantized into out [n, K]: per group code x scale (+ offset), a 4-bit weight's
 * terms added in order, one rounding per product and per sum (the build does not contract
 * them into fused multiply-adds): BlockLinear.rows, for an embedding tied to the head,
 * looked up every step. Returns 0, or KERNEL_BAD_ROW for an id
 * outside 0 .. N - 1 (nothing is written then). */
int block_rows_impl(const void *codes, const void *scale, const void *offset, int form, int bits, int N, int groups,
                    int terms, const int64_t *ids, int n, float *out) {
    const int per_term = groups / terms, K = per_term * GROUP;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return KERNEL_BAD_ROW;
    for (int i = 0; i < n; i++) {
        const int b = (int)(ids[i] / BLOCK), c = (int)(ids[i] % BLOCK);
        float *row = out + (size_t)i * K;
        for (int g = 0; g < groups; g++) {
            const float s = bits == 6 ? 0.0f : scale_at(scale, b, groups, g, c, form);
            float value[GROUP];
            if (bits == 6) {
                six_group_values((const uint8_t *)codes, (const uint8_t *)scale, groups, b, g, c, value);
            } else if (bits == 8) {
                const int8_t *group = (const int8_t *)codes + ((size_t)b * groups + g) * 512 + 4 * c;
                for (int j = 0; j < GROUP; j++) value[j] = (float)group[64 * (j / 4) + j % 4] * s;
            } else {
                const uint8_t *group = (const uint8_t *)codes + ((size_t)b * groups + g) * 256 + 4 * c;
                const float o = scale_at(offset, b, groups, g, c, form);
                for (int j = 0; j < 16; j++) {
                    const uint8_t byte = group[64 * (j / 4) + j % 4];
                    const float low = (float)(byte & 0x0F) * s, high = (float)(byte >> 4) * s;
                    value[j] = low + o;
                    value[j + 16] = high + o;
                }
            }
            float *into = row + (size_t)(g % per_term) * GROUP;
            for (int j = 0; j < GROUP; j++) into[j] = g < per_term ? value[j] : into[j] + value[j];
        }
    }
    return KERNEL_OK;
}

/* Rotary positions on one head vector: v * cos + rotate_half(v) * sin, rotate_half(v) being
 * [-v[D/2:], v[:D/2]] (transformers' convention). */
static inline void rope(const float *v, const float *cos, const float *sin, int D, float *out) {
    const int half = D / 2;
    for (int d = 0; d < half; d++) out[d] = v[d] * cos[d] - v[d + half] * sin[d];
    for (int d = half; d < D; d++) out[d] = v[d] * cos[d] + v[d - half] * sin[d];
}

/* One head vector v [D] rotated into out: first RMS-normalized by `norm` (the head's QK norm,
 * the build's rms_norm_impl) where there is one. */
static inline void normed_rope(const float *v, const float *norm, float eps, const float *cos, const float *sin,
                               int D, float *out) {
    float normed[MAX_HEAD_DIM];
    if (norm) {
        rms_norm_impl(v, norm, 1, D, eps, normed);
        v = normed;
    }
    rope(v, cos, sin, D, out);
}

/* One attention block of the lean forward: qkv [n, (H + 2 KVH) D] as the fused projection
 * gives it, each head's queries and keys normalized by q_norm, k_norm [D] (epsilon qk_eps;
 * NULL: not) before they are rotated, cos and sin [n, D] for each row's position (start + i in a chain, start + depth
 * in a token tree), keys and values [KVH, capacity, D] (written here at slots start..start +
 * n - 1), `parents` NULL for a chain or a tree's parent rows (causal_attention), out [n, H D].
 * Rotates queries and keys, stores keys and values, then attends. Every row's arithmetic is
 * its own. */
int attention_block_impl(const float *qkv, int n, int start, int H, int KVH, int D, const float *q_norm,
                         const float *k_norm, float qk_eps, const float *cos, const float *sin, float *keys,
                         float *values, int capacity, float scale, const int *parents, int window, float *out,
                         int threads) {
    const int width = (H + 2 * KVH) * D;
    float *q = (float *)malloc(sizeof(float) * (size_t)n * H * D);
    if (!q) return KERNEL_NO_MEMORY;
    for (int i = 0; i < n; i++) {
        const float *row = qkv + (size_t)i * width, *c = cos + (size_t)i * D, *s = sin + (size_t)i * D;
        for (int h = 0; h < H; h++) normed_rope(row + h * D, q_norm, qk_eps, c, s, D, q + ((size_t)i * H + h) * D);
        for (int h = 0; h < KVH; h++) {
            normed_rope(row + (H + h) * D, k_norm, qk_eps, c, s, D, keys + ((size_t)h * capacity + start + i) * D);
            memcpy(values + ((size_t)h * capacity + start + i) * D, row + (H + KVH + h) * D, sizeof(float) * D);
        }
    }
    int status = causal_attention_impl(q, keys, values, n, start, H, KVH, D, capacity, scale, parents, window, out,
                                       threads);
    free(q);
    return status;
}

/* causal_attention_impl of a build that attends one row of one head at a time (the scalar and
 * NEON builds): `attend` for every head and row, in parallel, each with its own scratch. */
int attention_by_rows(AttendRow attend, const float *q, const float *keys, const float *values, int n, int start, int H,
                      int KVH, int D, int capacity, float scale, const int *parents, int window, float *out,
                      int threads) {
    const int group = H / KVH;
    const size_t stride = (size_t)start + n + 8;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *weights = malloc(sizeof(float) * stride);
        int *slots = parents ? malloc(sizeof(int) * stride) : NULL;
        const int ready = weights && (!parents || slots);
        if (!ready) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for collapse(2) schedule(static)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < n; i++) {
                if (!ready) continue;
                const int length = parents ? tree_slots(parents, start, i, slots) : start + i + 1;
                const int lo = window_start(length, window); /* (a chain's slot k is key k) */
                const size_t skip = parents ? 0 : (size_t)lo * D;
                attend(q + ((size_t)i * H + h) * D, keys + (size_t)(h / group) * capacity * D + skip,
                       values + (size_t)(h / group) * capacity * D + skip, parents ? slots + lo : NULL, length - lo, D,
                       scale, weights, out + ((size_t)i * H + h) * D);
            }
        free(weights);
        free(slots);
    }
    return failed ? KERNEL_NO_MEMORY : KERNEL_OK;
}
