/* Products for 6-bit weights with a scale per 16 (bits 6: GGUF's Q6_K and Q3_K, held as the file
 * holds them, cpu_kernels_shared.h SIX_*): w = (code - 32) x factor x d, code 0..63, factor an
 * int8 per 16 weights, d a float16 per 8 groups. Each group's 32 products are summed in two
 * exact integer halves, one per scale, and each half meets its scale in one fused multiply-add
 * per column, in a fixed order: a row's result never depends on the number of rows (the width
 * invariance lossless speculation needs). An AVX2 and an AVX-512 VNNI version (the VNNI one in
 * the VNNI library only) form the same integers and float steps: the same numbers, as the
 * scalar reference (cpu_kernels_scalar.c) does. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels_vector.h"

/* Eight columns (half h) of a 6-bit weight's per-16 scale `part` (0: codes 0..15, 1: 16..31) of
 * group g: factor x d, exact. */
static inline __attribute__((always_inline)) __m256 six_scales8(const uint8_t *scales, int b, int G, int g, int part,
                                                                int h) {
    const uint8_t *block = scales + (size_t)b * G * SIX_SCALE_BYTES;
    const int8_t *factors = (const int8_t *)block + (size_t)g * 2 * BLOCK + part * BLOCK + h * 8;
    const uint16_t *supers = (const uint16_t *)(block + (size_t)G * 2 * BLOCK) + (g / SUPER_GROUPS) * BLOCK + h * 8;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)supers));
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)factors)));
    return _mm256_mul_ps(f, d);
}

/* Codes 0..63 of one half h of a block, chunk k, from the raw low-nibble chunk and the top
 * plane (cpu_kernels_shared.h SIX_*): `which` 0 takes the low nibbles (weights 4k + i), 1 the
 * high ones (16 + 4k + i). */
#define SIX_CODES(raw, top, k, which, low, two)                                                              \
    _mm256_or_si256(_mm256_and_si256((which) ? _mm256_srli_epi16(raw, 4) : (raw), low),                     \
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(top, 2 * (k)), two), 4))

/* Each half's integer sum is formed from the unsigned codes, sum(code x), less 32 times the
 * activations' sum over that half (Activations.sx16): exactly sum((code - 32) x), as the VNNI
 * build forms it too. maddubs pairs are at most 2 x 63 x 127, two chunks' add in int16. */
static inline __attribute__((always_inline)) void block6(const uint8_t *codes, const uint8_t *scales, int G,
                                                         const Activations *a, int m0, const int rows, int b, int N,
                                                         float *y, int ldy) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03), ones = _mm256_set1_epi16(1);
    const int K = G * GROUP;
    for (int h = 0; h < 2 && b * BLOCK + h * 8 < N; h++) {
        __m256 acc[SIX_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const uint8_t *group = codes + ((size_t)b * G + g) * SIX_GROUP_BYTES;
            if (h == 0) prefetch_codes(group, 6);
            const __m256i top0 = _mm256_loadu_si256((const __m256i *)(group + 256 + 64 * h));
            const __m256i top1 = _mm256_loadu_si256((const __m256i *)(group + 256 + 64 * h + 32));
            __m256i first[4], second[4];
            for (int k = 0; k < 4; k++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(group + 64 * k + 32 * h));
                first[k] = SIX_CODES(raw, top0, k, 0, low, two);
                second[k] = SIX_CODES(raw, top1, k, 1, low, two);
            }
            const __m256 s0 = six_scales8(scales, b, G, g, 0, h), s1 = six_scales8(scales, b, G, g, 1, h);
            for (int r = 0; r < rows; r++) {
                const size_t m = m0 + r;
                const int8_t *q = a->qx + m * K + (size_t)g * GROUP;
                __m256i sum0 = _mm256_setzero_si256(), sum1 = sum0;
                for (int k = 0; k < 4; k += 2) {
                    const __m256i p0 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(first[k], _mm256_set1_epi32(four_bytes(q + 4 * k))),
                        _mm256_maddubs_epi16(first[k + 1], _mm256_set1_epi32(four_bytes(q + 4 * k + 4))));
                    const __m256i p1 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(second[k], _mm256_set1_epi32(four_bytes(q + 16 + 4 * k))),
                        _mm256_maddubs_epi16(second[k + 1], _mm256_set1_epi32(four_bytes(q + 20 + 4 * k))));
                    sum0 = _mm256_add_epi32(sum0, _mm256_madd_epi16(p0, ones));
                    sum1 = _mm256_add_epi32(sum1, _mm256_madd_epi16(p1, ones));
                }
                sum0 = _mm256_sub_epi32(sum0, _mm256_set1_epi32(32 * a->sx16[(m * G + g) * 2]));
                sum1 = _mm256_sub_epi32(sum1, _mm256_set1_epi32(32 * a->sx16[(m * G + g) * 2 + 1]));
                const __m256 dx = _mm256_set1_ps(a->dx[m * G + g]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum0), _mm256_mul_ps(dx, s0), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum1), _mm256_mul_ps(dx, s1), acc[r]);
            }
        }
        const int first_column = b * BLOCK + h * 8, valid = N - first_column < 8 ? N - first_column : 8;
        for (int r = 0; r < rows; r++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r]);
            memcpy(y + (size_t)(m0 + r) * ldy + first_column, lanes, sizeof(float) * valid);
        }
    }
}

void block6_any(const uint8_t *codes, const uint8_t *scales, int G, const Activations *a, int m0, int rows, int b,
                int N, float *y, int ldy) {
    for (int r0 = 0; r0 < rows; r0 += SIX_ROWS) {
        switch (rows - r0 < SIX_ROWS ? rows - r0 : SIX_ROWS) {
        case 1: block6(codes, scales, G, a, m0 + r0, 1, b, N, y, ldy); break;
        case 2: block6(codes, scales, G, a, m0 + r0, 2, b, N, y, ldy); break;
        case 3: block6(codes, scales, G, a, m0 + r0, 3, b, N, y, ldy); break;
        default: block6(codes, scales, G, a, m0 + r0, 4, b, N, y, ldy); break;
        }
    }
}

#if SPECDRAFT_ISA == ISA_VNNI
/* ---- the same on AVX-512 VNNI: a register holds all 16 columns, vpdpbusd adds each column's
 * four code x activation products into its lane (the same integer sums, the same float steps
 * lane for lane, so the same numbers bit for bit) */

#define VNNI6 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define SIX_VNNI_ROWS 8

static VNNI6 inline __attribute__((always_inline)) __m512 six_scales16(const uint8_t *scales, int b, int G, int g,
                                                                       int part) {
    const uint8_t *block = scales + (size_t)b * G * SIX_SCALE_BYTES;
    const int8_t *factors = (const int8_t *)block + (size_t)g * 2 * BLOCK + part * BLOCK;
    const uint16_t *supers = (const uint16_t *)(block + (size_t)G * 2 * BLOCK) + (g / SUPER_GROUPS) * BLOCK;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)supers));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)factors))), d);
}

static VNNI6 inline __attribute__((always_inline)) void block6_vnni(const uint8_t *codes, const uint8_t *scales,
                                                                    int G, const Activations *a, int m0,
                                                                    const int rows, int b, int N, float *y, int ldy) {
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
    const int K = G * GROUP;
    __m512 acc[SIX_VNNI_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *group = codes + ((size_t)b * G + g) * SIX_GROUP_BYTES;
        prefetch_codes(group, 6);
        /* the top planes of all 16 columns: columns 0..7 at 256 + 32 p, 8..15 at 320 + 32 p */
        const __m512i top0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(group + 256))),
                                                _mm256_loadu_si256((const __m256i *)(group + 320)), 1);
        const __m512i top1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(group + 288))),
                                                _mm256_loadu_si256((const __m256i *)(group + 352)), 1);
        __m512i first[4], second[4];
        for (int k = 0; k < 4; k++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(group + 64 * k));
            first[k] = _mm512_or_si512(_mm512_and_si512(raw, low),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top0, 2 * k), two), 4));
            second[k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top1, 2 * k), two), 4));
        }
        const __m512 s0 = six_scales16(scales, b, G, g, 0), s1 = six_scales16(scales, b, G, g, 1);
        for (int r = 0; r < rows; r++) {
            const size_t m = m0 + r;
            const int8_t *q = a->qx + m * K + (size_t)g * GROUP;
            __m512i sum0 = _mm512_set1_epi32(-32 * a->sx16[(m * G + g) * 2]);
            __m512i sum1 = _mm512_set1_epi32(-32 * a->sx16[(m * G + g) * 2 + 1]);
            for (int k = 0; k < 4; k++) {
                sum0 = _mm512_dpbusd_epi32(sum0, first[k], _mm512_set1_epi32(four_bytes(q + 4 * k)));
                sum1 = _mm512_dpbusd_epi32(sum1, second[k], _mm512_set1_epi32(four_bytes(q + 16 + 4 * k)));
            }
            const __m512 dx = _mm512_set1_ps(a->dx[m * G + g]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum0), _mm512_mul_ps(dx, s0), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum1), _mm512_mul_ps(dx, s1), acc[r]);
        }
    }
    const int valid = block_columns(b, N);
    const __mmask16 lanes = valid == BLOCK ? 0xFFFF : (__mmask16)((1u << valid) - 1);
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + (size_t)(m0 + r) * ldy + b * BLOCK, lanes, acc[r]);
}

VNNI6 void block6_vnni_any(const uint8_t *codes, const uint8_t *scales, int G, const Activations *a, int m0, int rows,
                           int b, int N, float *y, int ldy) {
    for (int r0 = 0; r0 < rows; r0 += SIX_VNNI_ROWS) {
        switch (rows - r0 < SIX_VNNI_ROWS ? rows - r0 : SIX_VNNI_ROWS) {
        case 1: block6_vnni(codes, scales, G, a, m0 + r0, 1, b, N, y, ldy); break;
        case 2: block6_vnni(codes, scales, G, a, m0 + r0, 2, b, N, y, ldy); break;
        case 3: block6_vnni(codes, scales, G, a, m0 + r0, 3, b, N, y, ldy); break;
        case 4: block6_vnni(codes, scales, G, a, m0 + r0, 4, b, N, y, ldy); break;
        default: block6_vnni(codes, scales, G, a, m0 + r0, rows - r0 < 8 ? rows - r0 : 8, b, N, y, ldy); break;
        }
    }
}

#endif
