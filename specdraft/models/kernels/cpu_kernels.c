/* specdraft's CPU kernels on AVX2 (models/kernels/native.py builds them): the products for
 * weights in 4-bit and 8-bit groups of a GGUF file (models/kernels/block_linear.py), and RMSNorm
 * and SwiGLU for the lean forward (models/lean/decoder.py).
 *
 * The products: y[m, n] = sum over groups g of dx[m, g] * (s[n, g] * <c[n, g], qx[m, g]>
 * + o[n, g] * sx[m, g]), c a group's 32 codes (0..15, or int8 without offsets), s and o its
 * scale and offset (the weight is c * s + o), qx the activations quantized per row and group
 * of 32 to int8 with scale dx, sx their sum (as llama.cpp quantizes them). The weight layout,
 * and why every row's result is the same whatever the number of rows, is in
 * cpu_kernels_shared.h. The library compiled with -DSPECDRAFT_ISA=ISA_VNNI runs the 4-, 6- and
 * 8-bit products of cpu_kernels_vnni.c instead, bit for bit the same; cpu_kernels_scalar.c is
 * the same arithmetic in plain C (the reference the tests hold these to).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_vector.h"

/* max |x| over `groups` groups of 32 values (exact, whatever the order). */
float amax_of(const float *x, int groups) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 most = _mm256_setzero_ps();
    for (int k = 0; k < 4 * groups; k++) most = _mm256_max_ps(most, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)));
    return hmax(most);
}

/* `groups` groups of 32 values to int8 codes: each value times `inverse` rounded to nearest
 * even (cvtps2dq in the default rounding mode) and clamped to -127..127; s: each group's code
 * sum. */
void quantize_groups(const float *x, int groups, float inverse, int8_t *q, int32_t *s) {
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleave */
    const __m256 multiplier = _mm256_set1_ps(inverse);
    for (int g = 0; g < groups; g++) {
        const float *xg = x + g * GROUP;
        __m256i codes[4], sum = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            codes[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * k), multiplier));
            codes[k] = _mm256_max_epi32(_mm256_min_epi32(codes[k], top), bottom);
            sum = _mm256_add_epi32(sum, codes[k]);
        }
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                                 _mm256_packs_epi32(codes[2], codes[3]));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), _mm256_permutevar8x32_epi32(bytes, order));
        __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
        half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xB1));
        s[g] = _mm_cvtsi128_si32(half);
    }
}

/* Eight columns from `first` of rows m0 .. m0 + rows - 1 (fewer where the weight ends). */
static inline __attribute__((always_inline)) void store8(const __m256 *acc, int rows, int m0, int first, int N,
                                                         float *y, int ldy) {
    const int valid = N - first < 8 ? N - first : 8;
    for (int r = 0; r < rows; r++) {
        float *out = y + (size_t)(m0 + r) * ldy + first;
        if (valid == 8) {
            _mm256_storeu_ps(out, acc[r]);
        } else {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r]);
            memcpy(out, lanes, sizeof(float) * valid);
        }
    }
}

/* Eight columns' scales (or offsets), columns 8h .. 8h + 7 of block b's group g (G groups):
 * float32, or float16 widened exactly. */
static inline __attribute__((always_inline)) __m256 scales8(const void *p, int b, int G, int g, int h,
                                                            const int form) {
    const size_t at = ((size_t)b * G + g) * BLOCK + h * 8;
    if (form == SCALES_FLOAT16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
    return _mm256_loadu_ps((const float *)p + at);
}

/* The factored form (cpu_kernels_shared.h), the same eight columns: the d's of the super-block
 * holding group g, widened, and group g's values, its factors times those d's (exact). */
static inline __attribute__((always_inline)) __m256 supers8(const void *p, int b, int G, int g, int h) {
    const uint16_t *supers = (const uint16_t *)((const uint8_t *)p + (size_t)b * G * FACTORED_BYTES + (size_t)G * BLOCK);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(supers + (g / SUPER_GROUPS) * BLOCK + h * 8)));
}

static inline __attribute__((always_inline)) __m256 factored8(const void *p, int b, int G, int g, int h, __m256 d) {
    const uint8_t *factors = (const uint8_t *)p + (size_t)b * G * FACTORED_BYTES + (size_t)g * BLOCK + h * 8;
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)factors))), d);
}

/* Rows m0 .. m0 + rows - 1 of 4-bit weight block b, eight columns (one half) at a time. The
 * 16 products of a column and a group add up in int16 (at most 16 x 15 x 127) before one madd. */
static inline __attribute__((always_inline)) void block4(
        const uint8_t *codes, const void *scale, const void *offset, const int form, int G, int xgroups,
        const Activations *a, int m0, const int rows, int b, int N, float *y, int ldy) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int K = xgroups * GROUP;
    for (int h = 0; h < 2 && b * BLOCK + h * 8 < N; h++) {
        __m256 acc[ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        __m256 ds = _mm256_setzero_ps(), dm = ds; /* factored form: the super-block's d's, read once per 8 groups */
        for (int g = 0; g < G; g++) {
            const int xg = g % xgroups;
            const uint8_t *group = codes + ((size_t)b * G + g) * 256 + h * 32;
            if (h == 0) prefetch_codes(group, 4); /* (the second half reads the lines the first brought) */
            __m256i lo[4], hi[4];
            for (int k = 0; k < 4; k++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(group + k * 64));
                lo[k] = _mm256_and_si256(raw, low);
                hi[k] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            }
            if (form == SCALES_FACTORED && g % SUPER_GROUPS == 0)
                ds = supers8(scale, b, G, g, h), dm = supers8(offset, b, G, g, h);
            const __m256 s = form == SCALES_FACTORED ? factored8(scale, b, G, g, h, ds) : scales8(scale, b, G, g, h, form);
            const __m256 o = form == SCALES_FACTORED ? factored8(offset, b, G, g, h, dm) : scales8(offset, b, G, g, h, form);
            for (int r = 0; r < rows; r++) {
                const size_t m = m0 + r;
                const int8_t *q = a->qx + m * K + xg * GROUP;
                __m256i pairs = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo[k], _mm256_set1_epi32(four_bytes(q + 4 * k))));
                    pairs = _mm256_add_epi16(
                        pairs, _mm256_maddubs_epi16(hi[k], _mm256_set1_epi32(four_bytes(q + 16 + 4 * k))));
                }
                const __m256i isum = _mm256_madd_epi16(pairs, ones);
                const __m256 d = _mm256_mul_ps(_mm256_set1_ps(a->dx[m * xgroups + xg]), s);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a->ax[m * xgroups + xg]), o, acc[r]);
            }
        }
        store8(acc, rows, m0, b * BLOCK + h * 8, N, y, ldy);
    }
}

/* One specialisation per row count and scale form, so each loop is unrolled for its case. */
#define ROW_CASES(call, form)                                                                               \
    switch (rows) {                                                                                         \
    case 1: call(form, 1); break;                                                                           \
    case 2: call(form, 2); break;                                                                           \
    case 3: call(form, 3); break;                                                                           \
    default: call(form, 4); break;                                                                          \
    }

static __attribute__((unused)) void block4_any(const uint8_t *codes, const void *scale, const void *offset, int form, int G, int xgroups,
                       const Activations *a, int m0, int rows, int b, int N, float *y, int ldy) {
#define BLOCK4(f, r) block4(codes, scale, offset, f, G, xgroups, a, m0, r, b, N, y, ldy)
    FORM_CASES(form, ROW_CASES, BLOCK4)
#undef BLOCK4
}

/* The same for int8 codes: maddubs takes |w| and sign(q, w) (each pair at most 2 x 128 x 127). */
static inline __attribute__((always_inline)) void block8(
        const int8_t *codes, const void *scale, const int form, int G, const Activations *a, int m0, const int rows,
        int b, int N, float *y, int ldy) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int K = G * GROUP;
    for (int h = 0; h < 2 && b * BLOCK + h * 8 < N; h++) {
        __m256 acc[ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const int8_t *group = codes + ((size_t)b * G + g) * 512 + h * 32;
            const __m256 s = scales8(scale, b, G, g, h, form);
            for (int r = 0; r < rows; r++) {
                const size_t m = m0 + r;
                const int8_t *q = a->qx + m * K + (size_t)g * GROUP;
                __m256i isum = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(group + k * 64));
                    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(four_bytes(q + 4 * k)), w);
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), x), ones));
                }
                const __m256 d = _mm256_mul_ps(_mm256_set1_ps(a->dx[m * G + g]), s);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[r]);
            }
        }
        store8(acc, rows, m0, b * BLOCK + h * 8, N, y, ldy);
    }
}

static __attribute__((unused)) void block8_any(const int8_t *codes, const void *scale, int form, int G, const Activations *a, int m0,
                       int rows, int b, int N, float *y, int ldy) {
#define BLOCK8(f, r) block8(codes, scale, f, G, a, m0, r, b, N, y, ldy)
    if (form == SCALES_FLOAT16) ROW_CASES(BLOCK8, SCALES_FLOAT16) else ROW_CASES(BLOCK8, SCALES_FLOAT32)
#undef BLOCK8
}

/* Eight float weights of a block's row k (bits 16: bfloat16, widened exactly; 32: float32). */
static inline __attribute__((always_inline)) __m256 float_weights(const void *w, size_t at, int bits) {
    if (bits == 16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + at))), 16));
    return _mm256_loadu_ps((const float *)w + at);
}

/* Rows m0 .. m0 + rows - 1 of float-weight block b (cpu_kernels_shared.h): per column one sum
 * over k in order. One pass over the block's weights serves up to FLOAT_ROWS rows. */
static inline __attribute__((always_inline)) void block_float(const void *w, int bits, int K, const float *x,
                                                              int m0, const int rows, int b, int N, float *y,
                                                              int ldy) {
    __m256 lo_acc[FLOAT_ROWS], hi_acc[FLOAT_ROWS];
    for (int r = 0; r < rows; r++) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
    const size_t base = (size_t)b * K * BLOCK;
    const float *xr = x + (size_t)m0 * K;
    for (int k = 0; k < K; k++) {
        const __m256 lo = float_weights(w, base + (size_t)k * BLOCK, bits);
        const __m256 hi = float_weights(w, base + (size_t)k * BLOCK + 8, bits);
        for (int r = 0; r < rows; r++) {
            const __m256 v = _mm256_set1_ps(xr[(size_t)r * K + k]);
            lo_acc[r] = _mm256_fmadd_ps(v, lo, lo_acc[r]);
            hi_acc[r] = _mm256_fmadd_ps(v, hi, hi_acc[r]);
        }
    }
    store8(lo_acc, rows, m0, b * BLOCK, N, y, ldy);
    if (b * BLOCK + 8 < N) store8(hi_acc, rows, m0, b * BLOCK + 8, N, y, ldy);
}

static void block_float_any(const void *w, int bits, int K, const float *x, int m0, int rows, int b, int N,
                            float *y, int ldy) {
#define FLOAT_CASE(n) \
    case n: (bits == 16 ? block_float(w, 16, K, x, m0, n, b, N, y, ldy) : block_float(w, 32, K, x, m0, n, b, N, y, ldy)); break;
    switch (rows) {
    FLOAT_CASE(1) FLOAT_CASE(2) FLOAT_CASE(3) FLOAT_CASE(4) FLOAT_CASE(5)
    default: (bits == 16 ? block_float(w, 16, K, x, m0, 6, b, N, y, ldy) : block_float(w, 32, K, x, m0, 6, b, N, y, ldy));
    }
#undef FLOAT_CASE
}

/* y [M, N] (row stride ldy) = the quantized activations `a` of M rows times a weight in the
 * block layout: `bits` 4 (`groups` groups per column, K / 32 per term, with offsets), 6 or 8
 * (K / 32 groups, no offsets), or 16 / 32 (float weights, a->x). Weight blocks are split evenly
 * between threads; rows go in tiles that share each block's expanded codes. Which products run
 * is fixed when the library is compiled (SPECDRAFT_ISA). */
void block_products(const Activations *a, int M, int K, const void *codes, const void *scale, const void *offset,
                    int form, int bits, int N, int groups, float *y, int ldy, int threads) {
    const int blocks = (N + BLOCK - 1) / BLOCK;
#if SPECDRAFT_ISA == ISA_VNNI
    const int tile = FLOAT_WEIGHTS(bits) ? FLOAT_ROWS : VNNI_ROWS;
#else
    const int tile = FLOAT_WEIGHTS(bits) ? FLOAT_ROWS : ROWS;
#endif
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++)
        for (int m0 = 0; m0 < M; m0 += tile) {
            const int rows = M - m0 < tile ? M - m0 : tile;
            if (FLOAT_WEIGHTS(bits))
                block_float_any(codes, bits, K, a->x, m0, rows, b, N, y, ldy);
#if SPECDRAFT_ISA == ISA_VNNI
            else if (bits == 6)
                block6_vnni_any((const uint8_t *)codes, (const uint8_t *)scale, K / GROUP, a, m0, rows, b, N, y, ldy);
            else if (bits == 8)
                block8_vnni_any((const int8_t *)codes, scale, form, K / GROUP, a, m0, rows, b, N, y, ldy);
            else
                block4_vnni_any((const uint8_t *)codes, scale, offset, form, groups, K / GROUP, a, m0, rows, b, N, y,
                                ldy);
#else
            else if (bits == 6)
                block6_any((const uint8_t *)codes, (const uint8_t *)scale, K / GROUP, a, m0, rows, b, N, y, ldy);
            else if (bits == 8)
                block8_any((const int8_t *)codes, scale, form, K / GROUP, a, m0, rows, b, N, y, ldy);
            else
                block4_any((const uint8_t *)codes, scale, offset, form, groups, K / GROUP, a, m0, rows, b, N, y, ldy);
#endif
        }
}

/* RMSNorm of each row of x [rows, dim] into out: x / sqrt(mean(x^2) + eps) * weight, the
 * sum of squares in one fixed order per row (so a row's result never depends on the others). */
void rms_norm_impl(const float *x, const float *weight, int rows, int dim, float eps, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *o = out + (size_t)r * dim;
        __m256 acc = _mm256_setzero_ps();
        int d = 0;
        for (; d + 8 <= dim; d += 8) {
            __m256 v = _mm256_loadu_ps(xr + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float total = hsum(acc);
        for (; d < dim; d++) total += xr[d] * xr[d];
        const float scale = 1.0f / sqrtf(total / (float)dim + eps);
        const __m256 s = _mm256_set1_ps(scale);
        d = 0;
        for (; d + 8 <= dim; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + d), s), _mm256_loadu_ps(weight + d)));
        for (; d < dim; d++) o[d] = xr[d] * scale * weight[d];
    }
}

/* gate_up [rows, 2 I] -> out [rows, I] = silu(gate) * up, silu(g) = g / (1 + e^-g) taken as
 * g / (1 + t) for g >= 0 and g t / (1 + t) below, t = e^-|g| (exp_nonpositive: no overflow). */
void swiglu_impl(const float *gate_up, int rows, int inner, float *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), floor = _mm256_set1_ps(-87.0f);
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inner, *u = g + inner;
        float *o = out + (size_t)r * inner;
        int i = 0;
        for (; i + 8 <= inner; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 negative = _mm256_or_ps(x, sign);
            /* e^-|x|, 0 below -87 (exp_nonpositive clamps there, silu's tail is 0 at float precision) */
            const __m256 t = _mm256_andnot_ps(_mm256_cmp_ps(negative, floor, _CMP_LT_OQ), exp_nonpositive(negative));
            const __m256 numerator = _mm256_blendv_ps(one, t, x); /* t where x is negative */
            const __m256 silu = _mm256_mul_ps(x, _mm256_div_ps(numerator, _mm256_add_ps(one, t)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < inner; i++) {
            const float t = expf(-fabsf(g[i]));
            o[i] = g[i] * ((g[i] < 0.0f ? t : 1.0f) / (1.0f + t)) * u[i];
        }
    }
}
